"""Compile starvation (issue 28), at the unit level: absurd repetition counts are refused
before any compile, the actor's compile queue is bounded (a fast OVERLOADED) and shared
fairly between clients, a compile nobody waits for is cancelled (dropped from the queue,
or its child killed), and compile children die with the process that started them."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import pytest
import xgrammar as xgr

from grammar_cache import actor as actor_module
from grammar_cache import compile_pool as pool_module
from grammar_cache import envelope
from grammar_cache.actor import CompileQueue, GrammarCache, QueueFull
from grammar_cache.client import GrammarCacheClient
from grammar_cache.compile_pool import CompilePool, CompileResult
from grammar_cache.config import MAX_REPETITION, GrammarCacheConfig
from core.errors import ErrorKind, GrammarError, GrammarUnavailable
from core.grammar_spec import GrammarSpec

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def schema(**string):
    return GrammarSpec.json_schema({"type": "object", "required": ["a"],
                                    "properties": {"a": {"type": "string", **string}}})


# repetitions ------------------------------------------------------------------------

LEGITIMATE = [
    GrammarSpec.regex(r"\d{4}"), GrammarSpec.regex("[a-z]{1,3}"),
    GrammarSpec.regex(f"a{{{MAX_REPETITION}}}"), GrammarSpec.regex(r"a\{100000}"),
    GrammarSpec.regex("[{100000}]"), GrammarSpec.regex("[]{100000}]"),
    GrammarSpec.regex("(19|20)[0-9]{2}-[0-9]{2}-[0-9]{2}"),
    GrammarSpec.ebnf('root ::= "{100000}" [a-z]{1,3} # a{100000}'),
    GrammarSpec.lark('start: "a" ~ 3..5'),
    schema(pattern="^[0-9]{3}-[0-9]{4}$", maxLength=32767),  # real schemas use 32767
    GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"}, "maxItems": 65535}),
    GrammarSpec.json_schema({"enum": [{"pattern": "a{100000}"}]}),  # data, not a schema
]

ABSURD = [
    (GrammarSpec.regex("a{100001}"), "'{100001}'"),
    (GrammarSpec.regex("[a-z]{1,100002}"), "'{1,100002}'"),
    (GrammarSpec.regex("a{100003,}"), "'{100003,}'"),
    (GrammarSpec.regex("(ab){" + "9" * 5000 + "}"), "over 10**18"),
    (GrammarSpec.ebnf('root ::= "a"{0, 20000}'), "'{0, 20000}'"),
    (GrammarSpec.lark('start: "a" ~ 3..50000'), "'~ 3..50000'"),
    (schema(pattern="^x{20000}$"), "/properties/a/pattern"),
    (GrammarSpec.json_schema({"type": "object", "patternProperties": {"^k{20000}$": {}}}),
     "patternProperties"),
    (GrammarSpec.json_schema({"type": "array", "minItems": 20000}), "minItems 20000"),
    (schema(minLength=MAX_REPETITION + 1), f"minLength {MAX_REPETITION + 1}"),
    (GrammarSpec.structural_tag({"type": "structural_tag", "format": {
        "type": "regex", "pattern": "a{20000}"}}), "/format/pattern"),
    (GrammarSpec.structural_tag({"type": "structural_tag", "format": {
        "type": "grammar", "grammar": "root ::= [a]{20000}"}}), "/format/grammar"),
]


@pytest.mark.parametrize("spec", LEGITIMATE, ids=lambda s: s.describe())
def test_legitimate_repetitions_pass(spec):
    spec.check_repetitions(MAX_REPETITION)


@pytest.mark.parametrize("spec,named", ABSURD, ids=lambda x: getattr(x, "describe", str)())
def test_absurd_repetitions_are_refused_with_the_limit_named(spec, named):
    with pytest.raises(GrammarError) as err:
        spec.check_repetitions(MAX_REPETITION)
    assert err.value.kind is ErrorKind.GRAMMAR_TOO_LARGE
    assert named in str(err.value)
    assert str(MAX_REPETITION) in str(err.value) and "max_repetition" in str(err.value)


def test_the_limit_is_a_setting():
    spec = GrammarSpec.regex("a{500}")
    spec.check_repetitions(GrammarCacheConfig().max_repetition)
    with pytest.raises(GrammarError):
        spec.check_repetitions(GrammarCacheConfig(max_repetition=100).max_repetition)
    with pytest.raises(ValueError, match="max_repetition"):
        GrammarCacheConfig(max_repetition=2**31)  # xgrammar's counts are 32-bit


def test_the_scan_is_fast_on_the_largest_source():
    spec = GrammarSpec.regex("a{12345}b" * 28000)  # about 256 KB of repetitions
    t = time.perf_counter()
    with pytest.raises(GrammarError):
        spec.check_repetitions(MAX_REPETITION)
    assert time.perf_counter() - t < 0.5


def test_the_pool_refuses_without_a_child():
    pool = CompilePool(GrammarCacheConfig(), processes=1)
    try:
        t = time.perf_counter()
        result = pool.compile(GrammarSpec.regex("a{100001}"), "fp", "{}")
        assert time.perf_counter() - t < 0.5  # no tokenizer load, no compile
        assert result.error_kind is ErrorKind.GRAMMAR_TOO_LARGE and result.cacheable
        assert "{100001}" in result.error and not pool.busy
    finally:
        pool.close()


# the actor's logic, with a pool that compiles nothing ------------------------------


class FakePool:
    """Stands in for CompilePool: a compile waits until the test lets it go (or it is
    cancelled), and every compile is recorded."""

    def __init__(self, config=None, processes=None, start=None):
        self.config = config
        self.crashes = 0
        self.busy = {}
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.go = threading.Event()

    def wait_ready(self, timeout_s=None):
        pass

    def compile(self, spec, fingerprint, tokenizer_json, key=None, timeout_s=None, cancel=None):
        self.started.append(spec.source)
        while not self.go.wait(0.01):
            if cancel is not None and cancel.is_set():
                self.cancelled.append(spec.source)
                return CompileResult(envelope.pack_error("cancelled", fingerprint, key,
                                                         ErrorKind.GRAMMAR_UNAVAILABLE),
                                     "cancelled", ErrorKind.GRAMMAR_UNAVAILABLE)
        return CompileResult(envelope.pack_error("bad", fingerprint, key), "bad",
                             ErrorKind.INVALID_GRAMMAR, 0.1, 0.0)

    def close(self):
        pass


@pytest.fixture
def cache(monkeypatch):
    monkeypatch.setattr(actor_module, "CompilePool", FakePool)

    made = []

    def make(**config):
        c = GrammarCache(GrammarCacheConfig(disk=False, **config))
        c.register_tokenizer("fp", "{}")
        made.append(c)
        return c
    yield make
    for c in made:  # no compile thread left waiting
        c.pool.go.set()
        c.close()


def run(main):
    asyncio.run(asyncio.wait_for(main(), 10))


def kind_of(data: bytes):
    return msgpack.unpackb(data).get("error_kind")


async def settle():
    for _ in range(5):
        await asyncio.sleep(0.02)


def test_cache_refuses_a_huge_repetition_without_queueing(cache):
    async def main():
        c = cache()
        data = await asyncio.wait_for(c.get(GrammarSpec.regex("a{100001}"), "fp"), 5)
        assert kind_of(data) == ErrorKind.GRAMMAR_TOO_LARGE.value
        assert c.pool.started == [] and c.counts.too_large == 1
        assert not len(c.hot_list) and not c.distinct  # refused grammars take no memory
    run(main)


def test_a_full_compile_queue_refuses_a_new_grammar_at_once(cache):
    async def main():
        c = cache(compile_processes=1, max_queued_compiles=2)
        asks = [asyncio.ensure_future(c.get(GrammarSpec.regex(f"x{i}"), "fp"))
                for i in range(3)]  # one compiling, two waiting
        await settle()
        t = time.perf_counter()
        data = await c.get(GrammarSpec.regex("new"), "fp")
        assert time.perf_counter() - t < 0.1
        assert kind_of(data) == ErrorKind.OVERLOADED.value
        assert "max_queued_compiles" in msgpack.unpackb(data)["error"]
        assert c.counts.overloaded == 1 and c._cached_error(
            GrammarSpec.regex("new").key("fp")) is None  # never cached
        c.pool.go.set()
        assert all(kind_of(d) == "invalid_grammar" for d in await asyncio.gather(*asks))
        assert c.pool.started == ["x0", "x1", "x2"]
        # room again: the refused grammar compiles now
        assert kind_of(await c.get(GrammarSpec.regex("new"), "fp")) == "invalid_grammar"
    run(main)


def test_compile_slots_are_shared_round_robin_between_clients(cache):
    async def main():
        c = cache(compile_processes=1, max_queued_compiles=100)
        flood = [asyncio.ensure_future(c.get(GrammarSpec.regex(f"f{i}"), "fp", client="flood"))
                 for i in range(6)]
        await settle()
        polite = asyncio.ensure_future(c.get(GrammarSpec.regex("polite"), "fp", client="polite"))
        await settle()
        c.pool.go.set()
        await asyncio.gather(polite, *flood)
        # f0 was compiling; the polite client's one comes right after f1, not after f5
        assert c.pool.started.index("polite") == 2
    run(main)


def test_a_full_queue_makes_room_for_a_client_below_its_share(cache):
    async def main():
        c = cache(compile_processes=1, max_queued_compiles=4)
        flood = [asyncio.ensure_future(c.get(GrammarSpec.regex(f"f{i}"), "fp", client="flood"))
                 for i in range(5)]  # one compiling, four waiting: full
        await settle()
        more = await c.get(GrammarSpec.regex("f-more"), "fp", client="flood")
        assert kind_of(more) == "overloaded"  # the flooder has its share
        polite = asyncio.ensure_future(c.get(GrammarSpec.regex("polite"), "fp", client="polite"))
        await settle()
        assert c.counts.displaced == 1
        assert kind_of(await flood[-1]) == "overloaded"  # the flooder's newest gave way
        c.pool.go.set()
        assert kind_of(await polite) == "invalid_grammar"
        await asyncio.gather(*flood)
        assert "f4" not in c.pool.started and "polite" in c.pool.started
    run(main)


def test_a_queued_compile_nobody_waits_for_is_dropped(cache):
    async def main():
        c = cache(compile_processes=1)
        first = asyncio.ensure_future(c.get(GrammarSpec.regex("first"), "fp"))
        await settle()
        left = asyncio.ensure_future(c.get(GrammarSpec.regex("left"), "fp"))
        await settle()
        assert c.queue.waiting == 1
        left.cancel()  # Ray cancels the call: the asker left
        await settle()
        assert c.queue.waiting == 0 and c.counts.cancelled == 1
        c.pool.go.set()
        await first
        await settle()
        assert c.pool.started == ["first"]  # "left" was never compiled
        assert "left" not in str(c.inflight) and not c._compiles
        # asked again later: compiled then
        assert kind_of(await c.get(GrammarSpec.regex("left"), "fp")) == "invalid_grammar"
    run(main)


def test_a_running_compile_nobody_waits_for_is_stopped(cache):
    async def main():
        c = cache(compile_processes=1)
        ask = asyncio.ensure_future(c.get(GrammarSpec.regex("slow"), "fp"))
        await settle()
        ask.cancel()
        await settle()
        assert c.pool.cancelled == ["slow"]
        assert c.queue.free == 1  # its slot is free again
        c.pool.go.set()
        assert kind_of(await c.get(GrammarSpec.regex("next"), "fp")) == "invalid_grammar"
    run(main)


def test_a_compile_goes_on_while_someone_still_waits(cache):
    async def main():
        c = cache(compile_processes=1)
        first = asyncio.ensure_future(c.get(GrammarSpec.regex("shared"), "fp"))
        await settle()
        second = asyncio.ensure_future(c.get(GrammarSpec.regex("shared"), "fp"))
        await settle()
        first.cancel()
        await settle()
        assert c.pool.cancelled == []
        c.pool.go.set()
        assert kind_of(await second) == "invalid_grammar"
    run(main)


def test_queue_cancelled_waiter_is_skipped():
    async def main():
        q = CompileQueue(slots=1, limit=10)
        held = q.enter("a")
        waiting = q.enter("a")
        after = q.enter("b")
        waiting.cancel()  # its task was cancelled; it has not left yet
        q.leave("a", held)
        assert after.done() and not after.cancelled()
        q.leave("a", waiting)
        assert q.waiting == 0
        q.leave("b", after)
        assert q.free == 1
        with pytest.raises(QueueFull):
            q2 = CompileQueue(slots=1, limit=1)
            q2.enter(None), q2.enter(None), q2.enter(None)
    run(main)


# the worker's client ----------------------------------------------------------------


@pytest.fixture
def client(monkeypatch):
    info = xgr.TokenizerInfo(["<eos>", "a", "b"], stop_token_ids=[0])
    c = GrammarCacheClient(info, GrammarCacheConfig(disk=False))

    def no_local(*args, **kwargs):
        raise AssertionError("compiled in the worker")
    monkeypatch.setattr(c, "_compile_in_child", no_local)
    yield c
    c.close()


def test_client_refuses_a_huge_repetition_without_asking_the_actor(client, monkeypatch):
    monkeypatch.setattr(client, "_from_actor", lambda *a, **k: pytest.fail("asked the actor"))
    with pytest.raises(GrammarError) as err:
        client.fetch(GrammarSpec.regex("a{100001}"))
    assert err.value.kind is ErrorKind.GRAMMAR_TOO_LARGE


def test_client_passes_overloaded_on_and_does_not_compile_locally(client, monkeypatch):
    spec = GrammarSpec.regex("ab")
    busy = envelope.pack_error("queue full: retry", client.fingerprint,
                               spec.key(client.fingerprint), ErrorKind.OVERLOADED)
    seen = {}

    def from_actor(spec, lease=False, client=None, cancel=None):
        seen["client"] = client
        return busy
    monkeypatch.setattr(client, "_from_actor", from_actor)
    with pytest.raises(GrammarUnavailable) as err:
        client.fetch(spec, client="key-hash")
    assert err.value.kind is ErrorKind.OVERLOADED and seen["client"] == "key-hash"
    assert client.stats()["unavailable"] == 1 and client.stats()["local_fallbacks"] == 0


def test_grammar_unavailable_keeps_its_kind_across_pickling():
    import pickle
    exc = pickle.loads(pickle.dumps(GrammarUnavailable("busy", ErrorKind.OVERLOADED)))
    assert exc.kind is ErrorKind.OVERLOADED and str(exc) == "busy"
    assert GrammarUnavailable("x").kind is ErrorKind.GRAMMAR_UNAVAILABLE


# compile children -------------------------------------------------------------------

# a compile child that starts, takes a tokenizer and then never finishes a compile
HANGING_CHILD = textwrap.dedent("""
    import sys, time
    from grammar_cache.compile_worker import READY, read_frame, write_frame
    write_frame(sys.stdout.buffer, READY + b"test")
    read_frame(sys.stdin.buffer)
    write_frame(sys.stdout.buffer, b"ok")
    read_frame(sys.stdin.buffer)
    time.sleep(600)
""")


def test_pool_cancel_kills_the_compiling_child(monkeypatch):
    from grammar_cache import envelope
    # the fake child reports serialization version "test", which the pool teaches the
    # envelope module: put it back after, or later tests in this process see a mismatch
    monkeypatch.setattr(envelope, "_serialization", envelope._serialization)
    def popen(self):
        return subprocess.Popen([sys.executable, "-c", HANGING_CHILD], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, bufsize=0, cwd=ROOT,
                                env=dict(os.environ, PYTHONPATH=ROOT))
    monkeypatch.setattr(CompilePool, "_popen", popen)
    pool = CompilePool(GrammarCacheConfig(compile_timeout_s=60), processes=1)
    cancel = threading.Event()
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", pool.compile(
        GrammarSpec.regex("ab"), "fp", "{}", cancel=cancel)))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not pool.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        (pid,) = pool.busy
        cancel.set()
        thread.join(5)
        assert not thread.is_alive()
        assert box["r"].error_kind is ErrorKind.GRAMMAR_UNAVAILABLE and not box["r"].cacheable
        assert "cancelled" in box["r"].error and pool.cancelled == 1
        assert not _alive(pid)
    finally:
        cancel.set()
        pool.close()


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _start_parent(thread_lives_s: float) -> tuple[subprocess.Popen, int]:
    """A process that starts a CompilePool from a thread which ends ``thread_lives_s``
    later (as CompilePool._grow's does), then sleeps; and the pid of the pool's child."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, threading, time
        from grammar_cache.compile_pool import CompilePool
        box = {{}}
        def start():
            box["p"] = CompilePool(processes=1)
            print(box["p"]._idle.queue[0].process.pid, flush=True)
            time.sleep({thread_lives_s})
        threading.Thread(target=start).start()
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    return parent, int(parent.stdout.readline())


def _stop(parent: subprocess.Popen, child: int) -> None:
    parent.kill()
    parent.wait()
    if _alive(child):
        os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_compile_children_die_with_their_parent():
    parent, child = _start_parent(0)
    try:
        time.sleep(0.3)
        assert _alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        # the child is still importing xgrammar (seconds): it must not wait for that to
        # find its pipe closed, nor outlive the parent at all
        deadline = time.monotonic() + 2.0
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        _stop(parent, child)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_compile_children_outlive_the_thread_that_started_them():
    parent, child = _start_parent(1.0)  # the child has set its parent-death signal by then
    try:
        time.sleep(1.5)
        assert _alive(child)
    finally:
        _stop(parent, child)


def test_the_cache_actor_keeps_responses_conversations_for_every_front_end(cache):
    """RuntimeClient.remember_response / stored_response through the actor's own methods
    (GrammarCacheActor, without Ray): what one front end stored another finds, per owner,
    bounded by the actor's config; no actor, or one that fails, is "not found"."""
    from cluster.client import RuntimeClient

    c = cache(responses_max_stored=2)
    actor_cls = getattr(actor_module.GrammarCacheActor, "__ray_actor_class__",
                        actor_module.GrammarCacheActor)
    actor = object.__new__(actor_cls)
    actor.cache = c

    class Method:
        def __init__(self, fn):
            self.fn = fn

        async def remote(self, *args):
            return self.fn(*args)

    class Handle:
        remember_response = Method(actor.remember_response)
        stored_response = Method(actor.stored_response)

    fronts = [RuntimeClient(scheduler=object()) for _ in range(2)]
    for f in fronts:
        f._cache = Handle()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "HI"}]

    async def main():
        assert await fronts[0].remember_response("tacme", "resp_1", msgs, 60.0)
        assert await fronts[1].stored_response("tacme", "resp_1") == msgs
        assert await fronts[1].stored_response("tglobex", "resp_1") is None
        for i in (2, 3):  # past responses_max_stored: the oldest goes
            await fronts[1].remember_response("tacme", f"resp_{i}", msgs)
        assert await fronts[0].stored_response("tacme", "resp_1") is None
        assert c.stats()["responses_stored"] == 2

        class Down:
            class stored_response:  # noqa: N801 - a Ray method's shape
                @staticmethod
                async def remote(*args):
                    raise ConnectionError("gone")
            remember_response = stored_response
        fronts[0]._cache = Down()
        assert await fronts[0].stored_response("tacme", "resp_3") is None
        assert await fronts[0].remember_response("tacme", "resp_4", msgs) is False
    run(main)
