"""A bound on every grammar compile (issue 39, part 4), on byte-level vocabularies:

- llguidance compiles under parser limits of ours (``LLGUIDANCE_LIMITS``): a grammar over
  one is refused by name (grammar_too_large; ``auto`` serves it on xgrammar), a grammar
  over the per-step limits where it starts is refused at compile, and a matcher that
  reaches them mid-generation says so;
- schemas whose llguidance build would take seconds (thousands of properties, hundreds of
  optional ones in an object) are refused before it, and hostile schemas finish while a
  thread beside them (the engine's) keeps running;
- a compile whose last waiter gave up is cancelled: one still queued never starts, one in
  a child process is stopped, and the next ask compiles anew."""

import threading
import time

import pytest
import xgrammar as xgr

from grammar_cache.compile_pool import CompilePool
from grammar_cache.config import GrammarCacheConfig
from core.errors import ErrorKind, GrammarError, GrammarUnavailable
from core.grammar_spec import GrammarSpec
from worker.guided.backend import LLGUIDANCE, XGRAMMAR, EngineRefused
from worker.guided.llguidance_backend import (LLGUIDANCE_LIMITS, LLGuidanceBackend,
                                              _llguidance_grammar)
from worker.guided.guided_process import GuidedDecodingManager
from worker.guided.schema_budget import RewriteBudget, SchemaTooComplex

pytestmark = pytest.mark.unit

llguidance = pytest.importorskip("llguidance")
BYTES = llguidance.LLTokenizer("byte")


def byte_manager(**kwargs) -> GuidedDecodingManager:
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)]
                             + [f"<s{i}>".encode() for i in range(6)],
                             stop_token_ids=list(BYTES.eos_tokens))
    return GuidedDecodingManager(info, llguidance=lambda: LLGuidanceBackend(BYTES), **kwargs)


def objects(count: int, size: int, required: bool = False) -> dict:
    """``count`` objects of ``size`` string properties each (all optional, or required)."""
    def one():
        props = {f"p{i}": {"type": "string"} for i in range(size)}
        return {"type": "object", "properties": props,
                **({"required": list(props)} if required else {})}
    if count == 1:
        return one()
    return {"type": "object", "properties": {f"o{j}": one() for j in range(count)}}


# --- llguidance's parser limits -------------------------------------------------------------

def test_llguidance_compiles_under_our_limits():
    assert LLGuidanceBackend(BYTES).limits.step_lexer_fuel == LLGUIDANCE_LIMITS["step_lexer_fuel"]
    assert LLGuidanceBackend(BYTES).limits.max_lexer_states == LLGUIDANCE_LIMITS["max_lexer_states"]


def test_a_grammar_over_llguidance_limits_is_refused_by_name():
    """Over a limit is grammar_too_large naming it (not an invalid grammar), and under
    ``auto`` the grammar is served on xgrammar, as any refusal."""
    spec = GrammarSpec.json_schema(objects(1, 40, required=True))
    with pytest.raises(EngineRefused) as err:
        LLGuidanceBackend(BYTES, limits={"max_grammar_size": 100}).compile(spec)
    assert err.value.kind == ErrorKind.GRAMMAR_TOO_LARGE
    assert "llguidance's compile limits" in str(err.value)
    assert "grammar size" in str(err.value)
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)],
                             stop_token_ids=list(BYTES.eos_tokens))
    manager = GuidedDecodingManager(info, llguidance=lambda: LLGuidanceBackend(
        BYTES, limits={"max_grammar_size": 100}))
    try:
        assert manager.get_grammar(spec).result(timeout=60).engine == XGRAMMAR
        assert manager.stats.llguidance_refusals == 1
    finally:
        manager.shutdown()


def test_a_grammar_over_the_step_limits_at_its_start_is_refused_at_compile():
    """llguidance builds it, and would fail at the first mask step; with the probe it is
    refused while ``auto`` can still serve it on xgrammar."""
    engine = LLGuidanceBackend(BYTES, limits={"max_items_in_row": 100})
    with pytest.raises(EngineRefused) as err:
        engine.compile(GrammarSpec.json_schema(objects(1, 60)))
    assert err.value.kind == ErrorKind.GRAMMAR_TOO_LARGE
    assert "max is 100" in str(err.value)


def test_a_matcher_past_the_step_limits_says_why():
    """A step over the lexer fuel mid-generation puts llguidance's matcher in its error
    state for good: the token is refused and ``failure`` names the limit (the engine ends
    the request with it as grammar_too_large, not as a rejected-token bug)."""
    schema = {"type": "object", "required": ["p"], "properties": {
        "p": {"type": "string", "pattern": "^(a|b)*a(a|b){12}$"}}}
    engine = LLGuidanceBackend(BYTES, limits={"step_lexer_fuel": 300})
    matcher = engine.matcher(engine.compile(GrammarSpec.json_schema(schema)))
    bitmask = xgr.allocate_token_bitmask(1, BYTES.vocab_size)
    accepted = 0
    for byte in b'{"p": "ababababababababab':
        matcher.fill_bitmask(bitmask)
        if not matcher.accept_token(byte):
            break
        accepted += 1
    assert 8 < accepted < 24  # past the start (the compile probes that), inside the string
    assert "per-step limits" in matcher.failure() and "xgrammar" in matcher.failure()


# --- llguidance's build time ----------------------------------------------------------------

@pytest.mark.parametrize("schema, named", [
    (objects(1, 7500, required=True), "7500 properties"),  # 0.65-2.8 s to build
    (objects(16, 400), "6416 optional"),  # 0.4 s quiet, 2.3 s busy
    (objects(1, 3000), "3000 of them optional"),  # 0.8 s, then its first step fails
])
def test_schemas_llguidance_builds_in_seconds_are_refused_before_the_build(schema, named):
    with pytest.raises(EngineRefused) as err:
        _llguidance_grammar(GrammarSpec.json_schema(schema))
    assert err.value.kind == ErrorKind.GRAMMAR_TOO_LARGE and named in str(err.value)


def test_many_small_objects_still_compile():
    """200 objects of 20 properties (4,200 in all; ~0.5 s) are within the caps."""
    LLGuidanceBackend(BYTES).compile(GrammarSpec.json_schema(objects(200, 20)))


def test_the_rewrite_budget_counts_cpu_time_not_a_busy_machine():
    """The budget bounds how long a rewrite holds the interpreter: a thread that waits
    (for the GIL, for a core) spends none of it."""
    budget = RewriteBudget(units=10 ** 6, seconds=0.05)
    time.sleep(0.1)
    for _ in range(1024):
        budget.spend()
    with pytest.raises(SchemaTooComplex, match="took over"):
        spin = RewriteBudget(units=10 ** 9, seconds=0.05)
        while True:
            spin.spend()


def test_hostile_schemas_finish_while_the_engine_thread_runs():
    """The worst cases of the issue and of llguidance's build, on one manager: each
    finishes (refused, or served on xgrammar) within a generous bound, and a thread
    beside them, standing for the engine's step loop, is never held up for long (the
    rewrites hold the GIL for at most their budget; llguidance's build releases it)."""
    from tests.unit.test_compile_bounds_unit import allof_web, enum_web, not_chain

    hostile = [allof_web(7), not_chain(7), enum_web(500), objects(1, 7500, required=True),
               objects(16, 400), objects(1, 3000)]
    gaps, stop = [], threading.Event()

    def engine_thread():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    ticker = threading.Thread(target=engine_thread)
    ticker.start()
    manager = byte_manager()
    try:
        t = time.monotonic()
        futures = [manager.get_grammar(GrammarSpec.json_schema(s, engine=LLGUIDANCE,
                                                               strict=False))
                   for s in hostile]
        kinds = []
        for fut in futures:
            try:
                kinds.append(fut.result(timeout=30).engine)
            except GrammarError as exc:
                kinds.append(exc.kind)
        took = time.monotonic() - t
    finally:
        stop.set()
        ticker.join()
        manager.shutdown()
    assert kinds[0] == ErrorKind.INVALID_GRAMMAR  # its oneOf overlaps: llguidance's refusal
    assert kinds[1:] == [ErrorKind.GRAMMAR_TOO_LARGE] * 5
    assert took < 6.0  # generous: ~1 s here (the property-heavy ones took 6 s before)
    # generous: the rewrites stop at 25,000 steps (~0.05 s here for these); the wall time
    # of a GIL hold stretches on a loaded 2-core machine (0.55 s seen once in a CI run)
    assert max(gaps) < 1.0


# --- compiles nobody waits for --------------------------------------------------------------

EASY = GrammarSpec.regex("[ab]{3}", engine=XGRAMMAR)
SLOW = GrammarSpec.regex("[xy]{3}", engine=XGRAMMAR)


def test_a_queued_compile_whose_waiters_gave_up_never_starts():
    """One compile thread, held by a slow compile: a compile queued behind it whose only
    waiter gave up is skipped (it would hold the thread for nobody)."""
    manager = byte_manager(compile_threads=1)
    release, started = threading.Event(), []

    def fetch(spec, _client):
        started.append(spec.source)
        if spec == SLOW:
            release.wait(30)
        return xgr.GrammarCompiler(manager.tokenizer_info).compile_regex(spec.source)
    manager._fetch = fetch
    try:
        slow = manager.get_grammar(SLOW, waiter=True)
        queued = manager.get_grammar(EASY, waiter=True)
        manager.give_up(EASY, queued)
        release.set()
        slow.result(timeout=30)
        with pytest.raises(GrammarUnavailable, match="cancelled"):
            queued.result(timeout=30)
        assert started == [SLOW.source] and manager.stats.cancelled == 1
        # a new ask compiles it (the cancellation was not cached)
        assert manager.get_grammar(EASY).result(timeout=30).engine == XGRAMMAR
    finally:
        release.set()
        manager.shutdown()


class HangingPool:
    """A CompilePool whose compiles run until cancelled."""

    def __init__(self):
        self.cancels: list[threading.Event] = []

    def compile(self, spec, fingerprint, tokenizer_json, key=None, timeout_s=None,
                cancel=None):
        self.cancels.append(cancel)
        cancel.wait(60)
        return CompilePool._error("cancelled", ErrorKind.GRAMMAR_UNAVAILABLE, fingerprint, key)

    def close(self):
        pass


def test_the_last_waiter_giving_up_stops_a_compile_in_a_child():
    manager = byte_manager()
    manager.compile_pool, manager._tokenizer_json = HangingPool(), "{}"
    try:
        first = manager.get_grammar(SLOW, waiter=True)
        second = manager.get_grammar(SLOW, waiter=True)
        assert second is first
        deadline = time.monotonic() + 10
        while not manager.compile_pool.cancels and time.monotonic() < deadline:
            time.sleep(0.01)
        (cancel,) = manager.compile_pool.cancels
        manager.give_up(SLOW, first)
        assert not cancel.is_set()  # someone still waits
        manager.give_up(SLOW, second)
        assert cancel.is_set()
        with pytest.raises(GrammarUnavailable):
            first.result(timeout=10)
        # the next ask starts a compile of its own, not the cancelled one's future
        third = manager.get_grammar(SLOW, waiter=True)
        assert third is not first
        manager.give_up(SLOW, third)
    finally:
        manager.shutdown()


def test_a_compile_in_a_child_is_bounded_by_the_cache_limits():
    """An engine without the shared cache compiles xgrammar in its own CompilePool, under
    the grammar cache's limits; a repetition over the limit is refused without a child."""
    manager = byte_manager(compile_processes=1,
                           compile_limits=GrammarCacheConfig(max_repetition=100))
    try:
        assert manager.compile_pool.config.max_repetition == 100
        with pytest.raises(GrammarError) as err:
            manager.get_grammar(GrammarSpec.regex("a{1000}", engine=XGRAMMAR)).result(60)
        assert err.value.kind == ErrorKind.GRAMMAR_TOO_LARGE
    finally:
        manager.shutdown()


def test_a_fetch_from_the_cache_actor_nobody_waits_for_is_cancelled(monkeypatch):
    """In a cluster the engine's give-up reaches the cache actor: the worker stops
    waiting and cancels its call (the actor drops the compile if nobody else waits), and
    neither compiles the grammar itself nor counts the actor as down."""
    import ray

    from grammar_cache.client import GrammarCacheClient

    info = xgr.TokenizerInfo(["<eos>", "a", "b"], stop_token_ids=[0])
    client = GrammarCacheClient(info, GrammarCacheConfig(disk=False))
    ref, cancelled = object(), []

    class Actor:
        class get:
            @staticmethod
            def remote(*args):
                return ref
    monkeypatch.setattr(client, "_ready_actor", lambda: Actor)
    monkeypatch.setattr(client, "_compile_in_child",
                        lambda *a, **k: pytest.fail("compiled in the worker"))
    client._registered = True
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: (time.sleep(timeout), ([], refs))[1])
    monkeypatch.setattr(ray, "cancel", cancelled.append)
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    try:
        t = time.monotonic()
        with pytest.raises(GrammarUnavailable, match="cancelled"):
            client.fetch(SLOW, cancel=cancel)
        assert time.monotonic() - t < 5  # not the call's own timeout (45 s)
        assert cancelled == [ref] and client._down_until == 0.0
    finally:
        client.close()


def test_child_processes_are_the_default_where_an_engine_serves_requests():
    """A worker (which hands the engine its cluster's compile limits) compiles in child
    processes; an engine used directly, on a thread (a child's imports take seconds)."""
    from worker.engine.config import EngineConfig

    limits = GrammarCacheConfig(compile_processes=3)
    assert EngineConfig().compile_processes(limits) == 3
    assert EngineConfig().compile_processes(None) == 0
    assert EngineConfig(grammar_compile_processes=0).compile_processes(limits) == 0
    assert EngineConfig(grammar_compile_processes=2).compile_processes(None) == 2
