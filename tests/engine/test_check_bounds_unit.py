"""The worker's own grammar work is bounded (issue 58, items 1 and 2), on a byte-level
vocabulary:

- its compile queue (``FairQueue``): at most ``max_queued_compiles`` wait, fair between
  clients; past it a new grammar is OVERLOADED at once, a lighter client takes the place
  of the heaviest one's newest, and a compile nobody waits for leaves the line;
- the grammar check's reports (``CheckReports``) are built on a thread of their own, never
  on the caller's, kept per grammar key (a repeated check compiles and searches nothing,
  llguidance is never asked again for a grammar xgrammar serves), and queued within a
  bound, fair between clients, past which a check is OVERLOADED.

Jobs are held with events, never timed."""

import threading
from concurrent.futures import Future

import pytest
import xgrammar as xgr

from core.errors import ErrorKind, GrammarUnavailable
from core.grammar_spec import GrammarSpec
from grammar_cache.config import GrammarCacheConfig
from worker.guided.backend import LLGUIDANCE, XGRAMMAR
from worker.guided.check_reports import CheckReports
from worker.guided.compile_queue import FairQueue, QueueFull
from worker.guided.guided_process import GuidedDecodingManager
from worker.guided.llguidance_backend import LLGuidanceBackend

pytestmark = pytest.mark.unit

llguidance = pytest.importorskip("llguidance")
BYTES = llguidance.LLTokenizer("byte")


def byte_manager(**kwargs) -> GuidedDecodingManager:
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)]
                             + [f"<s{i}>".encode() for i in range(6)],
                             stop_token_ids=list(BYTES.eos_tokens))
    return GuidedDecodingManager(info, llguidance=lambda: LLGuidanceBackend(BYTES), **kwargs)


def schema(i: int) -> GrammarSpec:
    return GrammarSpec.json_schema({"type": "object", "properties": {
        f"p{i}": {"type": "integer"}}, "required": [f"p{i}"]})


class Gate:
    """Holds every job that calls it until opened; counts the ones that started."""

    def __init__(self):
        self.open = threading.Event()
        self.started = threading.Semaphore(0)

    def __call__(self, result=None):
        self.started.release()
        self.open.wait()
        return result


def overloaded(future: Future) -> bool:
    exc = future.exception() if future.done() else None
    return isinstance(exc, GrammarUnavailable) and exc.kind is ErrorKind.OVERLOADED


# --- FairQueue -------------------------------------------------------------------------------

def test_the_queue_refuses_past_its_limit_and_serves_clients_in_turn():
    queue, gate, order = FairQueue(1, 3), Gate(), []
    refused = []
    first = Future()
    queue.submit("a", first, gate, lambda: refused.append("first"))
    gate.started.acquire()  # the one thread holds "a"'s first job
    futures = {}
    for name in ("a1", "a2", "a3"):
        futures[name] = Future()
        queue.submit("a", futures[name], lambda n=name: order.append(n),
                     lambda n=name: refused.append(n))
    with pytest.raises(QueueFull):  # full, and "a" has every waiting place
        queue.submit("a", Future(), lambda: None, lambda: None)
    futures["b1"] = Future()  # a lighter client takes "a"'s newest place
    queue.submit("b", futures["b1"], lambda: order.append("b1"), lambda: refused.append("b1"))
    assert refused == ["a3"] and queue.waiting == 3
    assert queue.refusals == 1 and queue.displaced == 1
    gate.open.set()
    for name in ("a1", "a2", "b1"):
        futures[name].result(timeout=60)
    assert order == ["a1", "b1", "a2"]  # round robin: b's one job waits for one of a's


def test_a_dropped_job_never_runs():
    queue, gate, ran = FairQueue(1, 4), Gate(), []
    queue.submit("a", Future(), gate, lambda: None)
    gate.started.acquire()
    dropped, kept = Future(), Future()
    queue.submit("a", dropped, lambda: ran.append("dropped"), lambda: None)
    queue.submit("a", kept, lambda: ran.append("kept"), lambda: None)
    assert queue.drop(dropped) and not queue.drop(dropped)
    gate.open.set()
    kept.result(timeout=60)
    assert ran == ["kept"] and not dropped.done()


# --- the manager's compiles ------------------------------------------------------------------

def test_the_manager_refuses_new_grammars_past_its_queue_as_overloaded(monkeypatch):
    """One client's flood of distinct grammars: ``max_queued_compiles`` wait, the next is
    OVERLOADED at once (never queued), another client's grammar takes the flood's newest
    place, and every compile that ran was the ones queued."""
    manager = byte_manager(compile_limits=GrammarCacheConfig(max_queued_compiles=2))
    gate, build = Gate(), manager._build
    monkeypatch.setattr(manager, "_build", lambda spec, *a: gate(build(spec, *a)))
    try:
        running = manager.get_grammar(schema(0), "flood")
        gate.started.acquire()  # its one compile thread is held
        queued = [manager.get_grammar(schema(i), "flood") for i in (1, 2)]
        refused = manager.get_grammar(schema(3), "flood")
        assert overloaded(refused) and "max_queued_compiles" in str(refused.exception())
        assert manager.build_queue.waiting == 2 and manager.stats.overloaded == 1
        polite = manager.get_grammar(schema(99), "polite")
        assert overloaded(queued[1])  # displaced: the flood's newest
        assert manager.build_queue.waiting == 2 and not polite.done()
        # nothing was cached for the refused: asked again later, it compiles
        gate.open.set()
        for future in (running, queued[0], polite):
            assert future.result(timeout=60).engine == LLGUIDANCE
        assert manager.get_grammar(schema(3), "flood").result(timeout=60).engine == LLGUIDANCE
    finally:
        manager.shutdown()


def test_a_queued_compile_nobody_waits_for_leaves_the_queue(monkeypatch):
    manager = byte_manager(compile_limits=GrammarCacheConfig(max_queued_compiles=2))
    gate, build = Gate(), manager._build
    monkeypatch.setattr(manager, "_build", lambda spec, *a: gate(build(spec, *a)))
    try:
        manager.get_grammar(schema(0), "a")
        gate.started.acquire()
        future = manager.get_grammar(schema(1), "a", waiter=True)
        manager.give_up(schema(1), future)
        assert manager.build_queue.waiting == 0
        assert isinstance(future.exception(timeout=60), GrammarUnavailable)
    finally:
        gate.open.set()
        manager.shutdown()


# --- the grammar check's reports -------------------------------------------------------------

def check(reports: CheckReports, spec: GrammarSpec, client="c") -> dict:
    future, cached, _ = reports.start(spec, client)
    future.exception(timeout=60)
    return reports.report(spec, future, cached, 0.0, client).result(timeout=120)


def test_a_report_is_built_off_the_asking_thread_once_per_grammar(monkeypatch):
    manager = byte_manager()
    reports = CheckReports(manager)
    threads = []
    report_of = reports._build
    monkeypatch.setattr(reports, "_build", lambda *a: (
        threads.append(threading.current_thread()), report_of(*a))[1])
    try:
        spec = schema(1)
        first = check(reports, spec)
        assert first["status"] == "exact" and first["shortest_output"]["tokens"]
        assert threads and threading.current_thread() not in threads
        misses, searches = manager.stats.misses, reports._checker.closer.stats["searches"]
        again = check(reports, spec)
        assert again["cached"] is True
        assert {**again, "cached": False} == {**first, "cached": False}
        assert len(threads) == 1  # answered from the kept report: nothing built again
        assert manager.stats.misses == misses
        assert reports._checker.closer.stats["searches"] == searches
        assert reports.stats().report_hits == 1 and reports.stats().report_cpu_s > 0
    finally:
        reports.close()
        manager.shutdown()


def test_llguidance_is_asked_once_for_a_grammar_xgrammar_serves(monkeypatch):
    """Forced xgrammar: llguidance's verdict is compiled once, for the first report; auto
    after llguidance's refusal: the refusal the compile met is reported, never asked
    again."""
    manager = byte_manager()
    asked = []
    refusal = manager.llguidance_refusal
    monkeypatch.setattr(manager, "llguidance_refusal",
                        lambda spec: (asked.append(spec), refusal(spec))[1])
    reports = CheckReports(manager)
    try:
        forced = GrammarSpec.json_schema(schema(1).parsed, engine=XGRAMMAR)
        for _ in range(3):
            report = check(reports, forced)
            assert report["engine"] == XGRAMMAR
            assert report["engines"][LLGUIDANCE]["verdict"] == "exact"
        assert asked == [forced]
        # llguidance refuses this one (an unimplemented keyword): auto serves xgrammar
        refused = GrammarSpec.json_schema({"type": "object", "properties": {"a": {
            "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}})
        report = check(reports, refused)
        assert report["engine"] == XGRAMMAR
        assert report["engines"][LLGUIDANCE]["verdict"] == "refused"
        assert asked == [forced]
    finally:
        reports.close()
        manager.shutdown()


def test_reports_wait_in_a_bounded_queue_fair_between_clients():
    manager = byte_manager()
    reports = CheckReports(manager, limit=1)
    gate = Gate()
    try:
        reports.queue.submit("other", Future(), gate, lambda: None)
        gate.started.acquire()  # the report thread is held
        specs = [schema(i) for i in range(3)]
        asked = []
        for spec in specs:
            future, cached, _ = reports.start(spec, "flood")
            future.exception(timeout=60)
            asked.append(reports.report(spec, future, cached, 0.0, "flood"))
        assert not asked[0].done()  # queued: the one place
        assert all(overloaded(f) for f in asked[1:])
        assert reports.stats().reports_overloaded == 2 and reports.queue.waiting == 1
        gate.open.set()
        assert asked[0].result(timeout=120)["status"] == "exact"
        # refused reports were not kept or left in flight: asked again, they are built
        future, cached, _ = reports.start(specs[1], "flood")
        future.exception(timeout=60)
        again = reports.report(specs[1], future, cached, 0.0, "flood").result(timeout=120)
        assert again["status"] == "exact"
    finally:
        gate.open.set()
        reports.close()
        manager.shutdown()


def test_a_clients_checks_past_their_compile_share_are_refused_before_any_compile():
    """grammar_cache.check_compile_share (worker/guided/compile_meter.py): with no burst,
    one compile puts the client over; its next new grammar is refused (OVERLOADED, with
    the wait) and nothing is compiled, while another client and a grammar already held
    are answered."""
    manager = byte_manager(compile_limits=GrammarCacheConfig(
        check_compile_share=0.001, check_compile_burst_s=0.0))
    reports = CheckReports(manager)
    try:
        first = check(reports, schema(1), client="flood")
        assert first["status"] == "exact"
        misses = manager.stats.misses
        with pytest.raises(GrammarUnavailable) as refused:
            reports.start(schema(2), "flood")
        assert refused.value.kind is ErrorKind.OVERLOADED
        assert refused.value.retry_after_s >= 1.0 and "check_compile_share" in str(
            refused.value)
        assert manager.stats.misses == misses  # nothing was queued or compiled
        assert check(reports, schema(1), client="flood")["cached"] is True  # held: free
        assert check(reports, schema(3), client="polite")["status"] == "exact"
        assert reports.stats().reports_throttled == 1
    finally:
        reports.close()
        manager.shutdown()
