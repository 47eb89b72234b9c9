"""The shared grammar cache: one compile per key cluster-wide, hard time limit, fallback when
the actor is down and reuse when it is back, envelope checks, byte-bounded LRU, one error
vocabulary (kinds, messages), transient failures never cached, one config.
Real Ray (a local instance), real child-process compiles."""

import asyncio
import os
import signal
import threading
import time
import uuid

import msgpack
import pytest
import ray
import xgrammar as xgr

from grammar_cache import envelope
from grammar_cache.actor import GrammarCache, GrammarCacheConfig, get_or_create_actor, wait_ready
from grammar_cache.client import GrammarCacheClient
from grammar_cache.compile import GrammarError, compile_spec, tokenizer_fingerprint
from core.errors import ErrorKind, GrammarUnavailable
from core.grammar_spec import GrammarSpec

pytestmark = pytest.mark.integration

# the disk tier is off in tests (tests/conftest.py): these count compiles and actor hits

VOCAB = ["<eos>", "{", "}", '"', "a", "b", ":", ",", " ", "1", "2", "true", "false", "[", "]",
         "x", "y", "z", "0", "-"] + [chr(c) for c in range(ord("c"), ord("w"))]


def long_strings(n):
    """n required strings with distinct long length bounds: about 0.6 s each to compile with
    the default model's tokenizer."""
    return GrammarSpec.json_schema({"type": "object", "required": [f"p{i}" for i in range(n)],
                                    "properties": {f"p{i}": {"type": "string",
                                                             "minLength": 1000 + 37 * i,
                                                             "maxLength": 3000 + 53 * i}
                                                   for i in range(n)}})


# about 6 s: far past a limit of 1 s or less (stopped there, so its length costs no time)
SLOW = long_strings(10)
# about 2.5 s: still compiling a moment after it starts (to kill it, or to fail its wait),
# and seconds quicker than SLOW where a test then waits for its full compile
SLOW_BRIEF = long_strings(4)


def tiny_info():
    return xgr.TokenizerInfo(VOCAB, stop_token_ids=[0])


def spec(i=0):
    return GrammarSpec.json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"}},
                                    "required": [f"p{i}"]})


@pytest.fixture(scope="module")
def ray_local(shared_ray):
    with shared_ray():  # every named actor (the caches these tests start) gone after
        yield


@pytest.fixture
def actor_name(ray_local):
    return f"gc-{uuid.uuid4().hex[:8]}"


def new_actor(name, **config):
    actor = get_or_create_actor(GrammarCacheConfig(**config), name=name)
    wait_ready(actor)
    return actor


def through_cache(st: dict) -> int:
    """Fetches the cache served: hits, verdicts, and first compiles here under a lease."""
    return st["actor_hits"] + st["verdicts"] + st["worker_compiles"]


def default_info(tokenizer):
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[2])


@ray.remote(num_cpus=0.5)
def fetch_in_task(name, spec):
    client = GrammarCacheClient(tiny_info(), name=name)
    try:
        compiled = client.fetch(spec)  # a GrammarSpec, pickled with its cached key
        m = xgr.GrammarMatcher(compiled)
        return m.accept_string('{"p0": 7}') and m.accept_token(0), client.stats()
    finally:
        client.close()


def test_four_processes_one_compile(actor_name):
    actor = new_actor(actor_name)
    slowish = GrammarSpec.json_schema({"type": "object", "properties": {
        "p0": {"type": "integer"}, "pad": {"type": "string", "maxLength": 3000}},
        "required": ["p0"]})
    results = ray.get([fetch_in_task.remote(actor_name, slowish) for _ in range(4)])
    assert all(ok for ok, _ in results)
    assert all(through_cache(st) == 1 and st["local_fallbacks"] == 0 for _, st in results)
    stats = ray.get(actor.stats.remote())
    assert stats["compiles"] == 1
    assert stats["misses"] == 1 and stats["hits"] + stats["joined"] == 3


def test_concurrent_asks_share_one_compile():
    cache = GrammarCache(GrammarCacheConfig(compile_processes=2))
    info = tiny_info()
    fp = tokenizer_fingerprint(info)
    cache.register_tokenizer(fp, info.serialize_json())

    async def main():
        return await asyncio.gather(*(cache.get(spec(1), fp) for _ in range(4)))

    try:
        datas = asyncio.run(main())
        assert len(set(datas)) == 1
        assert cache.counts.compiles == 1 and cache.counts.joined == 3
    finally:
        cache.close()


def test_slow_compile_stopped_at_limit_while_others_finish(actor_name, default_tokenizer):
    actor = new_actor(actor_name, compile_timeout_s=1.0, compile_processes=2)
    client = GrammarCacheClient(default_info(default_tokenizer),
                                GrammarCacheConfig(compile_timeout_s=1.0), name=actor_name)
    client.fetch(spec(0))  # registers the tokenizer, warms a compile process
    fp = client.fingerprint
    slow_ref = actor.get.remote(SLOW, fp)
    fast_refs = [actor.get.remote(spec(i), fp) for i in range(1, 4)]
    fast = ray.get(fast_refs)
    slow = ray.get(slow_ref)
    assert all("error" not in envelope.read_header(d) for d in fast)
    header = envelope.read_header(slow)
    # a valid grammar over the limit: its own kind, the limit and how to raise it
    assert header["error_kind"] == ErrorKind.COMPILE_TIMEOUT.value
    assert "limit of 1 s" in header["error"] and "compile_timeout_s" in header["error"]
    assert "invalid" not in header["error"]
    with pytest.raises(GrammarError, match="compile_timeout_s") as err:
        client.fetch(SLOW)  # the failure is cached: answered at once
    assert err.value.kind is ErrorKind.COMPILE_TIMEOUT and err.value.kind.client_fault
    stats = ray.get(actor.stats.remote())
    assert stats["timeouts"] == 1 and stats["compiles"] == 5 and stats["cached_errors"] == 1
    # the actor and its pool survive: a new compile still works
    assert "error" not in envelope.read_header(ray.get(actor.get.remote(spec(9), fp)))
    client.close()


def test_killed_compile_process_is_transient_and_not_cached(actor_name, default_tokenizer):
    actor = new_actor(actor_name, compile_timeout_s=120, compile_processes=1)
    client = GrammarCacheClient(default_info(default_tokenizer),
                                GrammarCacheConfig(compile_timeout_s=120), name=actor_name)
    try:
        client.fetch(spec(0))  # registered, the compile process warm
        outcome = {}

        def ask():
            try:
                outcome["grammar"] = client.fetch(SLOW_BRIEF)
            except Exception as exc:  # noqa: BLE001 - the test looks at what came back
                outcome["error"] = exc

        asker = threading.Thread(target=ask)
        asker.start()
        key = SLOW_BRIEF.key(client.fingerprint)
        deadline = time.monotonic() + 60
        pids = {}
        while not pids and time.monotonic() < deadline:  # wait until the compile is running
            pids = {p: k for p, k in ray.get(actor.compile_pids.remote()).items() if k == key}
            time.sleep(0.05)
        assert pids, "the slow compile never started"
        os.kill(next(iter(pids)), signal.SIGKILL)  # the compile process dies mid-compile
        asker.join()
        assert "grammar" not in outcome
        assert isinstance(outcome["error"], GrammarUnavailable)  # transient: a 503, retry
        assert not isinstance(outcome["error"], GrammarError)
        assert outcome["error"].kind is ErrorKind.GRAMMAR_UNAVAILABLE
        stats = ray.get(actor.stats.remote())
        assert stats["unavailable"] == 1 and stats["cached_errors"] == 0
        assert stats["compile_crashes"] == 1 and client.stats()["unavailable"] == 1
        # nothing was cached: the next ask compiles (in a fresh process) and succeeds
        compiled = client.fetch(SLOW_BRIEF)
        assert xgr.GrammarMatcher(compiled).accept_string('{"p0": "')
        stats = ray.get(actor.stats.remote())
        assert stats["misses"] == 3 and stats["compiles"] == 3 and stats["errors"] == 1
    finally:
        client.close()


def test_bad_grammar_error_is_cached(actor_name):
    actor = new_actor(actor_name)
    client = GrammarCacheClient(tiny_info(), name=actor_name)
    bad = GrammarSpec.regex("(unclosed")
    for _ in range(2):
        with pytest.raises(GrammarError, match="invalid regex grammar") as err:
            client.fetch(bad)
        assert err.value.kind is ErrorKind.INVALID_GRAMMAR
    stats = ray.get(actor.stats.remote())
    assert stats["compiles"] == 1 and stats["errors"] == 1 and stats["hits"] == 1


def test_actor_down_falls_back_then_back_in_use(actor_name):
    actor = new_actor(actor_name)
    client = GrammarCacheClient(tiny_info(), GrammarCacheConfig(compile_timeout_s=10),
                                name=actor_name)
    try:
        client.fetch(spec(0))
        assert client.stats()["local_fallbacks"] == 0
        ray.kill(actor, no_restart=True)
        compiled = client.fetch(spec(1))  # still served: compiled locally
        assert xgr.GrammarMatcher(compiled).accept_string('{"p1": 1}')
        stats = client.stats()
        assert stats["local_fallbacks"] == 1 and stats["actor_failures"] == 1
        assert stats["actor_skipped"]
        client._down_until = 0.0  # don't wait out the 5 s skip
        actor = new_actor(actor_name)  # the cache is back under its name
        client.fetch(spec(2))
        stats = client.stats()
        assert through_cache(stats) == 2
        assert stats["local_fallbacks"] == 1
        assert ray.get(actor.stats.remote())["tokenizers"] == 1  # registered again
    finally:
        client.close()


def test_restarted_actor_is_used_again(actor_name):
    actor = new_actor(actor_name)
    client = GrammarCacheClient(tiny_info(), name=actor_name)
    client.fetch(spec(0))
    ray.kill(actor, no_restart=False)  # Ray restarts it (max_restarts=-1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the kill is asynchronous: wait for the new instance
        try:
            if ray.get(actor.stats.remote(), timeout=5)["compiles"] == 0:
                break
        except Exception:
            pass
        time.sleep(0.1)
    client._down_until = 0.0  # a ping that timed out during the restart: don't wait 5 s
    client.fetch(spec(1))
    stats = ray.get(actor.stats.remote())
    assert stats["compiles"] == 1 and stats["tokenizers"] == 1  # a fresh actor, used
    assert through_cache(client.stats()) == 2
    client.close()


def test_local_verdict_compiles_in_process(actor_name):
    actor = new_actor(actor_name, local_verdict_factor=0.0)  # every grammar gets a verdict
    client = GrammarCacheClient(tiny_info(), GrammarCacheConfig(worker_first_compile=False),
                                name=actor_name)
    compiled = client.fetch(spec(3))
    assert xgr.GrammarMatcher(compiled).accept_string('{"p3": 12}')
    st = client.stats()
    assert (st["actor_hits"], st["verdicts"], st["local_fallbacks"]) == (0, 1, 0)
    stats = ray.get(actor.stats.remote())
    assert stats["local_verdicts"] == 1 and stats["compiles"] == 1
    header = envelope.read_header(ray.get(actor.get.remote(spec(3), client.fingerprint)))
    assert header["local"] and "grammar" not in header  # small: no serialized grammar
    client.close()


def test_verdict_compile_in_process_is_bounded(actor_name, default_tokenizer):
    # the actor compiles SLOW_BRIEF within its (large) limit and sends a verdict; this
    # worker's limit is far below its compile time, so its watchdog fails the request as
    # transient (the grammar is fine) instead of letting it wait unbounded
    actor = new_actor(actor_name, compile_timeout_s=120, local_verdict_factor=0.0)  # noqa: F841 - kept: the actor lives while a handle does
    client = GrammarCacheClient(default_info(default_tokenizer),
                                GrammarCacheConfig(compile_timeout_s=0.2), name=actor_name,
                                rpc_timeout_s=150)
    try:
        with pytest.raises(GrammarUnavailable, match="did not compile within 0.2 s"):
            client.fetch(SLOW_BRIEF)
        st = client.stats()
        assert st["verdicts"] == 1 and st["verdict_timeouts"] == 1
        # while that compile still runs (xgrammar cannot stop it), another verdict does
        # not queue behind it in this process: it goes to the killable child process
        compiled = client.fetch(spec(4))
        assert xgr.GrammarMatcher(compiled).accept_string('{"p4": 1}')
        assert client.stats()["verdicts_in_child"] == 1
    finally:
        client.close()


def test_fresh_actor_is_waited_for_not_skipped(actor_name):
    # issue 14: a client asking a just-created actor (still starting its compile processes)
    # waits for its readiness instead of timing out a ping and compiling by itself
    actor = get_or_create_actor(GrammarCacheConfig(compile_processes=2), name=actor_name)
    client = GrammarCacheClient(tiny_info(), name=actor_name)
    try:
        client.fetch(spec(5))
        st = client.stats()
        assert st["local_fallbacks"] == 0 and st["actor_failures"] == 0
        assert through_cache(st) == 1 and st["registrations"] == 1
        assert st["fetches"] == 1 and st["fetch_wait_s"] > 0
        assert ray.get(actor.stats.remote())["ready"]
    finally:
        client.close()


def test_envelope_mismatch_is_caught():
    info = tiny_info()
    fp = tokenizer_fingerprint(info)
    compiled = xgr.GrammarCompiler(info).compile_regex("ab")
    data = envelope.pack(compiled, fp, "k")
    assert envelope.unpack(data, info, fp, "k") is not None
    with pytest.raises(envelope.EnvelopeMismatch, match="fp"):
        envelope.unpack(data, info, "another-tokenizer", "k")
    with pytest.raises(envelope.EnvelopeMismatch, match="key"):
        envelope.unpack(data, info, fp, "other-key")
    for field, value in [("v", 999), ("xgr", "0.0.1"), ("ser", "v0")]:
        env = msgpack.unpackb(data)
        env[field] = value
        with pytest.raises(envelope.EnvelopeMismatch, match=field):
            envelope.unpack(msgpack.packb(env), info, fp, "k")
    with pytest.raises(envelope.EnvelopeMismatch):
        envelope.unpack(msgpack.packb([1, 2]), info, fp)
    for junk in (b"", b"\xc1", msgpack.packb({"v": 1})[:-1]):  # never a msgpack error
        with pytest.raises(envelope.EnvelopeMismatch):
            envelope.unpack(junk, info, fp)
    other = xgr.TokenizerInfo(VOCAB[:-1], stop_token_ids=[0])
    assert tokenizer_fingerprint(other) != fp


def test_byte_limit_evicts_least_recently_used():
    info = tiny_info()
    fp = tokenizer_fingerprint(info)
    # no compile-locally verdicts: every entry is a full envelope of about the same size
    cache = GrammarCache(GrammarCacheConfig(compile_processes=1,
                                            local_verdict_factor=float("inf")))
    cache.register_tokenizer(fp, info.serialize_json())

    async def get(i):
        return await cache.get(spec(i), fp)

    async def main():
        size = len(await get(0))
        cache.lru.max_bytes = int(size * 2.5)  # room for two entries of this size
        await get(1)
        await get(0)  # 0 is now the most recently used
        await get(2)  # over budget: 1 goes
        keys = [spec(i).key(fp) for i in range(3)]
        return [k in cache.lru for k in keys]

    try:
        assert asyncio.run(main()) == [True, False, True]
        stats = cache.stats()
        assert stats["evictions"] == 1 and stats["bytes"] <= stats["max_bytes"]
    finally:
        cache.close()


def test_envelope_error_kinds():
    info = tiny_info()
    fp = tokenizer_fingerprint(info)
    for kind in (ErrorKind.INVALID_GRAMMAR, ErrorKind.GRAMMAR_TOO_LARGE,
                 ErrorKind.COMPILE_TIMEOUT, ErrorKind.COMPILE_MEMORY):
        with pytest.raises(GrammarError) as err:
            envelope.unpack(envelope.pack_error("m", fp, "k", kind), info, fp, "k")
        assert err.value.kind is kind
    with pytest.raises(GrammarUnavailable):  # a compile process that failed: transient
        envelope.unpack(envelope.pack_error("m", fp, "k", ErrorKind.GRAMMAR_UNAVAILABLE),
                        info, fp, "k")


@pytest.mark.parametrize("grammar, expected", [
    # a pattern in a schema: the pattern and where it is, not our generated EBNF's position
    (GrammarSpec.json_schema({"type": "object", "properties": {
        "code": {"type": "string", "pattern": "[z-a]"}}}),
     "the pattern at /properties/code/pattern ('[z-a]')"),
    (GrammarSpec.json_schema({"type": "object", "patternProperties": {
        "a|*": {"type": "string"}}}), "the pattern at /patternProperties/a|* ('a|*')"),
    (GrammarSpec.json_schema({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "(x"}}}),
     "pattern at /properties/id/pattern ('(x') is not a regex xgrammar supports: the "
     "parenthesis is not closed"),
    (GrammarSpec.json_schema({"type": "array", "prefixItems": [{"type": "integer"}],
                              "minItems": 3, "items": False}),
     "minItems is greater than the number of prefixItems"),
    (GrammarSpec.regex("a{3,1}"), "invalid regex grammar: lower bound is larger than upper"),
    (GrammarSpec.regex("(x"), "invalid regex grammar: the parenthesis is not closed (at position"),
    (GrammarSpec.structural_tag({"type": "structural_tag", "format": {"type": "bogus"}}),
     "invalid structural_tag grammar: format type not recognized: bogus"),
    (GrammarSpec.structural_tag({"type": "structural_tag", "format": {
        "type": "json_schema", "json_schema": {"type": "string", "pattern": "x{2,1}"}}}),
     "the pattern at /format/json_schema/pattern ('x{2,1}')"),
    # EBNF the user wrote keeps its position
    (GrammarSpec.ebnf('root ::= "a'), "EBNF lexer error at line 1, column 12"),
])
def test_compile_errors_speak_of_what_the_user_wrote(grammar, expected):
    compiler = xgr.GrammarCompiler(tiny_info(), max_threads=1, cache_enabled=False)
    with pytest.raises(GrammarError) as err:
        compile_spec(compiler, grammar)
    message = str(err.value)
    assert expected in message
    assert err.value.kind is ErrorKind.INVALID_GRAMMAR
    assert "Check failed" not in message and ".cc:" not in message
    if grammar.kind != "ebnf":
        assert "EBNF" not in message and "line 1, column" not in message


def test_config_is_one_validated_model():
    config = GrammarCacheConfig(compile_timeout_s=3, compile_processes=1)
    assert GrammarCacheConfig(**config.model_dump()) == config  # how it crosses Ray
    with pytest.raises(ValueError, match=r"grammar_cache\.compile_timeout_s"):
        GrammarCacheConfig(compile_timeout_s=-1)
    with pytest.raises(ValueError, match=r"grammar_cache\.compile_timeout_s.*finite"):
        GrammarCacheConfig(compile_timeout_s=float("inf"))
    with pytest.raises(ValueError, match=r"grammar_cache\.timeout: unknown key.*compile_timeout_s"):
        GrammarCacheConfig(timeout=3)
    with pytest.raises(ValueError, match=r"grammar_cache\.compile_processes"):
        GrammarCacheConfig(compile_processes="many")


def test_fallback_pool_honours_configured_limits(ray_local):
    # no actor under this name: every compile is a local fallback, under the client's config
    client = GrammarCacheClient(tiny_info(), GrammarCacheConfig(compile_memory_mb=1024,
                                                                compile_timeout_s=7),
                                name=f"absent-{uuid.uuid4().hex[:6]}")
    try:
        compiled = client.fetch(spec(6))
        assert xgr.GrammarMatcher(compiled).accept_string('{"p6": 1}')
        assert client.stats()["local_fallbacks"] == 1
        pool = client._local_pool()
        assert pool.config.compile_memory_mb == 1024 and pool.config.compile_timeout_s == 7
        assert pool.processes == 1
    finally:
        client.close()


def test_engines_compile_through_the_shared_cache(actor_name, default_model,
                                                  default_tokenizer, default_model_dir):
    # needs the engine's grammar_fetch factory (worker/engine, another change in flight)
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine
    from worker.engine.sampling import SamplingParams
    from core.request import GenerationRequest

    actor = new_actor(actor_name)
    clients = []

    def grammar_fetch(info):
        clients.append(GrammarCacheClient(info, name=actor_name))
        return clients[-1].fetch

    # xgrammar pinned: the shared cache serves xgrammar's artifacts (llguidance compiles
    # in the worker, in a millisecond, and never asks the actor)
    config = EngineConfig(progress=False, num_kv_blocks=256, grammar_engine="xgrammar")
    engines = [LLMEngine(config, model=default_model,
                         tokenizer=default_tokenizer, model_dir=default_model_dir,
                         grammar_fetch=grammar_fetch) for _ in range(2)]
    choice = GrammarSpec.choice(["red", "green", "blue"])
    try:
        for engine in engines:
            req = GenerationRequest([{"role": "user", "content": "Pick a color."}],
                                    SamplingParams(max_new_tokens=8, temperature=0),
                                    grammar=choice)
            out = engine.generate([req])[req.request_id]
            assert out.text in ("red", "green", "blue")
        stats = ray.get(actor.stats.remote())
        # the second engine got the first one's grammar (or waited for its publication)
        assert stats["compiles"] == 1 and stats["hits"] + stats["joined"] == 1
    finally:
        for c in clients:
            c.close()


def test_compile_pool_starts_more_processes_only_when_compiles_overlap():
    from grammar_cache.compile_pool import CompilePool

    info = tiny_info()
    fp, tok_json = tokenizer_fingerprint(info), info.serialize_json()
    pool = CompilePool(GrammarCacheConfig(compile_processes=2), start=1)
    try:
        pool.wait_ready()
        assert pool.started == 1
        assert pool.compile(spec(1), fp, tok_json).error is None  # one at a time: one process
        assert pool.started == 1
        # the only child is held as if it were compiling (a tiny grammar's compile ends in
        # a millisecond: threads left to overlap by chance often do not), so every compile
        # below finds every started child busy
        held = pool._idle.get(timeout=10)
        results = []
        threads = [threading.Thread(target=lambda i=i: results.append(
            pool.compile(spec(10 + i), fp, tok_json))) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while pool.started < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.started == 2  # a compile that found every child busy started another
        pool._idle.put(held)
        for t in threads:
            t.join(timeout=120)
        assert [r.error for r in results] == [None, None, None]
        assert pool.started == 2  # and no more than compile_processes
    finally:
        pool.close()


def test_fallback_process_warms_only_when_no_grammar_is_being_fetched(monkeypatch,
                                                                     default_tokenizer):
    # a cold cluster's first compiles must not compete with the fallback's imports: the
    # warm-up waits while a fetch is in flight or recent, then starts the process
    from grammar_cache import client as client_mod
    monkeypatch.setattr(client_mod, "FALLBACK_WARM_DELAY_S", 0.1)
    monkeypatch.setattr(client_mod, "FALLBACK_WARM_QUIET_S", 0.3)
    client = GrammarCacheClient(default_info(default_tokenizer), GrammarCacheConfig(),
                                name=f"absent-{uuid.uuid4().hex[:8]}")
    try:
        with client._lock:
            client._fetching = 1  # as while fetch() runs
        time.sleep(1.0)  # the warm-up looked three times (0.1, 0.4, 0.7 s) and waited
        assert client._local is None
        with client._lock:
            client._fetching, client._last_fetch = 0, time.monotonic()
        deadline = time.monotonic() + 60
        while client._local is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client._local is not None
        client._local.wait_ready()
        assert client._local.started == 1
    finally:
        client.close()


def test_compile_limit_is_cpu_time_and_a_starved_compile_is_not_the_grammars_fault(
        default_tokenizer):
    # the limit counts the child's CPU time: a child that gets none (stopped, as on a
    # machine whose cores are all decoding) is stopped at the wall-time backstop with a
    # transient error, never cached; a grammar that really is slow is still COMPILE_TIMEOUT
    from grammar_cache.compile_pool import WALL_FACTOR, CompilePool

    info = default_info(default_tokenizer)  # SLOW takes seconds with a real vocabulary
    fp, tok_json = tokenizer_fingerprint(info), info.serialize_json()
    # the backstop (WALL_FACTOR x the limit) is what the starved compile waits for; a
    # second keeps the fresh child's window wide enough on a loaded 2-core machine
    limit = 1.0
    pool = CompilePool(GrammarCacheConfig(compile_processes=1, compile_timeout_s=limit))
    try:
        pool.wait_ready()
        assert pool.compile(spec(1), fp, tok_json).error is None  # tokenizer loaded
        pid = next(iter(w.process.pid for w in list(pool._idle.queue)))
        box = {}
        t = threading.Thread(target=lambda: box.update(r=pool.compile(SLOW, fp, tok_json)))
        t.start()
        time.sleep(0.2)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        t.join(timeout=60)
        starved = box["r"]
        assert starved.error_kind == ErrorKind.GRAMMAR_UNAVAILABLE, starved.error
        assert not starved.cacheable and "busy" in starved.error
        assert time.monotonic() - t0 >= WALL_FACTOR * limit - 0.5
        assert pool.starved == 1
        slow = pool.compile(SLOW, fp, tok_json)  # a fresh child, running freely
        assert slow.error_kind == ErrorKind.COMPILE_TIMEOUT and slow.cacheable, slow.error
    finally:
        pool.close()


def test_load_cost_measures_then_estimates_from_size(monkeypatch):
    """The compile process trial-loads a grammar to learn the load rate, then estimates
    big ones from their size (a trial load costs as much as the worker's own), and
    measures again every REMEASURE-th."""
    from grammar_cache.compile_worker import LoadCost
    info = tiny_info()
    compiled = compile_spec(xgr.GrammarCompiler(info), GrammarSpec.regex("[a-z]{1,40}"))
    serialized = compiled.serialize_json()
    loads = []
    real = xgr.CompiledGrammar.deserialize_json
    monkeypatch.setattr(xgr.CompiledGrammar, "deserialize_json",
                        staticmethod(lambda s, i: loads.append(len(s)) or real(s, i)))
    cost = LoadCost()
    cost.MEASURE_BYTES = cost.RATE_BYTES = 1  # this grammar counts as big
    seconds, measured = cost(serialized, info)
    assert measured and seconds > 0 and loads == [len(serialized)]
    seconds, measured = cost(serialized, info)  # estimated from the learned rate
    assert not measured and seconds == pytest.approx(cost.rate * len(serialized))
    assert len(loads) == 1
    results = [cost(serialized, info)[1] for _ in range(cost.REMEASURE)]
    assert results.count(True) == 1 and len(loads) == 2  # measured again once
    small = LoadCost()  # under MEASURE_BYTES: always measured, no rate learned
    assert small(serialized, info)[1] and small(serialized, info)[1]
    assert small.rate is None


# first compiles in the asking worker (leases) -------------------------------------------

# ordinary (no long bounds: eligible for a first compile in the worker) and slow enough with
# the default model's tokenizer to pass a sub-second limit
SLOWISH_ORDINARY = GrammarSpec.json_schema({
    "type": "object", "required": ["q"],
    "properties": {"q": {"type": "string", "minLength": 10, "maxLength": 900}}})


def wait_for(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


LEASES = GrammarCacheConfig(worker_first_compile=True)


def test_leases_are_off_by_default(actor_name):
    actor = new_actor(actor_name)  # noqa: F841 - kept: the actor lives while a handle does
    client = GrammarCacheClient(tiny_info(), name=actor_name)
    try:
        assert not client._may_compile_here(spec(1))
        client.fetch(spec(1))
        st = client.stats()
        assert st["worker_compiles"] == 0 and st["actor_hits"] + st["verdicts"] == 1
    finally:
        client.close()


def test_first_compile_runs_in_the_asking_worker_and_is_published(actor_name):
    actor = new_actor(actor_name)
    client = GrammarCacheClient(tiny_info(), LEASES, name=actor_name)
    try:
        compiled = client.fetch(spec(11))
        assert xgr.GrammarMatcher(compiled).accept_string('{"p11": 3}')
        st = client.stats()
        assert st["worker_compiles"] == 1 and st["actor_hits"] == 0
        # the client counts its publish once the actor's answer is back (in a background
        # thread at low priority): the actor may count it first
        wait_for(lambda: ray.get(actor.stats.remote())["lease_publishes"] == 1
                 and client.stats()["publishes"] == 1)
        stats = ray.get(actor.stats.remote())
        assert stats["leases"] == 1 and stats["compiles"] == 1 and stats["entries"] == 1
        # another process gets what this one published: no second compile anywhere
        other = ray.get(fetch_in_task.remote(actor_name, spec(0)))
        assert other[0]
        ok, st2 = ray.get(fetch_in_task.remote(actor_name, spec(11)))
        assert st2["actor_hits"] == 1 and st2["worker_compiles"] == 0
        assert ray.get(actor.stats.remote())["compiles"] == 2  # spec(11) once, spec(0) once
    finally:
        client.close()


def test_grammar_error_found_under_a_lease_is_everyones(actor_name):
    actor = new_actor(actor_name)
    client = GrammarCacheClient(tiny_info(), LEASES, name=actor_name)
    bad = GrammarSpec.regex("(unclosed")
    try:
        with pytest.raises(GrammarError, match="invalid regex grammar"):
            client.fetch(bad)
        wait_for(lambda: ray.get(actor.stats.remote())["lease_publishes"] == 1)
        header = envelope.read_header(ray.get(actor.get.remote(bad, client.fingerprint)))
        assert header["error_kind"] == ErrorKind.INVALID_GRAMMAR.value
        stats = ray.get(actor.stats.remote())
        assert stats["compiles"] == 1 and stats["errors"] == 1 and stats["cached_errors"] == 1
    finally:
        client.close()


def test_grammars_that_do_not_look_ordinary_compile_in_the_child(actor_name):
    actor = new_actor(actor_name)
    client = GrammarCacheClient(tiny_info(), LEASES, name=actor_name)
    long_bound = GrammarSpec.json_schema({"type": "string", "maxLength": 2000})
    try:
        assert not client._may_compile_here(long_bound)
        assert client._may_compile_here(spec(1))
        client.fetch(long_bound)
        st = client.stats()
        assert st["worker_compiles"] == 0 and st["actor_hits"] + st["verdicts"] == 1
        assert ray.get(actor.stats.remote())["leases"] == 0
    finally:
        client.close()


def test_first_compile_past_the_limit_goes_back_to_the_actor(actor_name, default_tokenizer):
    # this worker's limit (0.3 s of CPU) is far below the grammar's compile: its watchdog
    # hands the lease back and the actor's child (limit 120 s) compiles it for everyone
    actor = new_actor(actor_name, compile_timeout_s=120)
    client = GrammarCacheClient(default_info(default_tokenizer),
                                GrammarCacheConfig(compile_timeout_s=0.3,
                                                   worker_first_compile=True), name=actor_name,
                                rpc_timeout_s=150)
    try:
        compiled = client.fetch(SLOWISH_ORDINARY)
        assert xgr.GrammarMatcher(compiled).accept_string('{"q": "')
        st = client.stats()
        assert st["worker_compile_timeouts"] == 1 and st["lease_releases"] == 1
        assert st["worker_compiles"] == 0 and st["actor_hits"] + st["verdicts"] == 1
        stats = ray.get(actor.stats.remote())
        assert stats["leases"] == 1 and stats["lease_releases"] == 1
        assert stats["compiles"] == 2  # the lease, then the actor's own compile
    finally:
        client.close()


def test_lease_waiters_get_the_publication_or_the_actors_compile(monkeypatch):
    import grammar_cache.actor as actor_mod
    cache = GrammarCache(GrammarCacheConfig(compile_processes=1, compile_timeout_s=0.1))
    info = tiny_info()
    fp = tokenizer_fingerprint(info)
    cache.register_tokenizer(fp, info.serialize_json())
    monkeypatch.setattr(actor_mod, "LEASE_SERIALIZE_S", 0.5)

    async def published():
        lease = await cache.get(spec(1), fp, lease=True)
        assert envelope.read_header(lease)["lease"]
        waiter = asyncio.ensure_future(cache.get(spec(1), fp, lease=True))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # it waits for the holder, not a second lease
        data = envelope.pack(xgr.GrammarCompiler(info).compile_json_schema(
            spec(1).source), fp, spec(1).key(fp))
        assert cache.publish(fp, spec(1).key(fp), data)
        return await waiter, data

    async def lapsed():  # the holder never publishes: the actor compiles it
        await cache.get(spec(2), fp, lease=True)
        return await asyncio.wait_for(cache.get(spec(2), fp), 60)

    try:
        got, sent = asyncio.run(published())
        assert got == sent and cache.counts.joined == 1
        cache.wait_ready_for_test = None
        data = asyncio.run(lapsed())
        assert envelope.unpack(data, info, fp, spec(2).key(fp)) is not None
        assert cache.counts.lease_lapses == 1 and cache.counts.compiles == 3
        assert not cache.leases and not cache.inflight
        assert not cache.publish(fp, spec(2).key(fp), sent)  # too late: ignored
    finally:
        cache.close()


def test_big_loads_give_the_heap_back(actor_name, monkeypatch):
    # loading a big grammar leaves hundreds of MB in the loading thread's arena unless the
    # heap is trimmed; small envelopes are not worth a trim
    import grammar_cache.client as client_mod
    calls = []
    monkeypatch.setattr(client_mod, "_trim_heap", lambda: calls.append(1))
    monkeypatch.setattr(client_mod, "TRIM_AFTER_BYTES", 0)
    actor = new_actor(actor_name)  # noqa: F841 - kept: the actor lives while a handle does
    client = GrammarCacheClient(tiny_info(), name=actor_name)
    try:
        client.fetch(spec(12))
        assert calls
        calls.clear()
        monkeypatch.setattr(client_mod, "TRIM_AFTER_BYTES", 1 << 40)
        client.fetch(spec(13))
        assert not calls
    finally:
        client.close()
