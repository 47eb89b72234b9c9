"""CheckReports: a worker's grammar-check reports (``POST /v1/grammars``), built off the
engine thread, once per grammar key.

    reports = CheckReports(guided)                          # one per worker
    future, cached, began = reports.start(spec, client)     # the request path's compile
    report = reports.report(spec, future, cached, waited_s, client)   # a Future of the dict

A report is read off the compiled grammar (grammar_check.py ``GrammarChecker``) on a
thread of its own with a closing search of its own, so decoding goes on while it is
built; the engine thread is never asked. Reports wait in a ``FairQueue`` of one thread
(compile_queue.py): at most ``limit`` wait, shared fairly between clients, and past that a
new report is refused with GrammarUnavailable OVERLOADED (a 429), as a new compile is.
Each report's CPU is bounded (``GrammarChecker.budget_s`` on its searches, besides the
searches' own limits), and a report is kept per grammar key (at most ``max_reports``,
``max_bytes`` of JSON; a refusal for the grammar cache's ``error_ttl_s``), so a repeated
check compiles and searches nothing: it is answered from here, and the facts the report
left on the grammar for admission are put back should the grammar have been compiled
again since.

The thread still shares the interpreter with the engine thread: what a report costs it is
the report's CPU (``report_cpu_s``), at most ``budget_s`` plus one search at a time.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable

from core.errors import ErrorKind, GrammarError, GrammarUnavailable
from core.grammar_spec import GrammarSpec
from grammar_cache.stats import CheckStats
from worker.guided.backend import GrammarFacts
from worker.guided.closing import CLOCK, CompletionSearch
from worker.guided.compile_meter import MAX_RUNNING, CompileMeter
from worker.guided.compile_queue import FairQueue, QueueFull
from worker.guided.grammar_check import GrammarChecker

# a report's own CPU beyond which its shortest-output search is not refined (the
# searches it has made stand); each search is also bounded by the engine's time limit
REPORT_CPU_S = 0.25


def queue_stats(guided, counts: CheckStats | None = None) -> CheckStats:
    """``counts`` with the manager's compile queues' sizes and refusals now (summed over
    its two queues, each bounded by ``max_queued_compiles``)."""
    queues = guided.queues
    return dataclasses.replace(
        counts or CheckStats(), compiles_waiting=sum(q.waiting for q in queues),
        compiles_running=sum(q.running for q in queues),
        compiles_refused=sum(q.refusals for q in queues),
        compiles_displaced=sum(q.displaced for q in queues))


@dataclasses.dataclass
class _Kept:
    report: dict
    facts: GrammarFacts | None  # its admission facts (GrammarFacts.admission)
    size: int
    expires: float  # monotonic; inf for a grammar that compiled


class CheckReports:
    def __init__(self, guided, *, limit: int | None = None, max_reports: int = 1024,
                 max_bytes: int = 16 * 2**20, budget_s: float = REPORT_CPU_S,
                 busy: Callable[[str | None], bool] = lambda client: True):
        """``limit``: reports that may wait (default the compile queue's,
        ``max_queued_compiles``); ``busy(client)``: whether the worker serves other
        clients' requests now (a client's compile share applies only then: CompileMeter)."""
        self.busy = busy
        self.guided = guided
        self.queue = FairQueue(1, limit or guided.queue.limit, "grammar-check")
        self.max_reports = max_reports
        self.max_bytes = max_bytes
        self.budget_s = budget_s
        self.counts = CheckStats()
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._size = 0  # what the kept reports hold, as JSON
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._checker: GrammarChecker | None = None  # built on the report thread
        limits = guided.compile_limits
        self.meter = CompileMeter(limits.check_compile_share, limits.check_compile_burst_s)

    def start(self, spec: GrammarSpec, client: str | None) -> tuple[Future, bool, float]:
        """The compile a request would start (GrammarChecker.start), from any thread.
        Raises GrammarUnavailable OVERLOADED when the check needs work here (no kept
        report, no compiled grammar) and ``client``'s checks have as many compiles running
        as they may, or (while the worker serves other clients' requests) have had their
        share of its compile time lately (``CompileMeter``; grammar_cache.check_compile_share)."""
        cached = self.guided.holds(spec)
        if not cached and not self._kept_now(spec.key(self.guided.fingerprint)):
            wait = self.meter.wait_s(client, self.busy(client))
            if wait > 0:
                with self._lock:
                    self.counts.reports_throttled += 1
                raise GrammarUnavailable(
                    f"this client's grammar checks have {MAX_RUNNING} compiles running on "
                    f"this worker or, while it serves other clients, have used their share of "
                    f"its compile time ({self.meter.share:g} of a core, in bursts of "
                    f"{self.meter.burst_s:g} s: grammar_cache.check_compile_share); retry "
                    f"in {wait:.0f} s", ErrorKind.OVERLOADED, retry_after_s=wait)
        future = self.guided.get_grammar(spec, client)
        if not future.done():  # charged once it ends, at what its job took
            self.meter.begin(client)
            future.add_done_callback(
                lambda f: self.meter.end(client, getattr(f, "cost_s", 0.0)))
        return future, cached, time.perf_counter()

    def _kept_now(self, key: str) -> bool:
        with self._lock:
            kept = self._kept.get(key)
            return kept is not None and time.monotonic() < kept.expires

    def report(self, spec: GrammarSpec, future: Future, cached: bool, waited_s: float,
               client: str | None) -> Future:
        """A future of the report on ``spec`` (as a dict) once ``future`` (from ``start``)
        is done: the kept one, the one being built, or a new one queued for ``client``.
        Fails with GrammarUnavailable: the compile's own transient failure, or OVERLOADED
        when the report queue is full and ``client`` has its share of it."""
        key = spec.key(self.guided.fingerprint)
        answer: Future = Future()
        error = future.exception() if future.done() else None
        if error is not None and not isinstance(error, GrammarError):
            answer.set_exception(error)  # says nothing of the grammar: nothing to build
            return answer
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None and time.monotonic() < kept.expires:
                self._kept.move_to_end(key)
                self.counts.report_hits += 1
                self._restore(kept, future)
                answer.set_result({**kept.report, "cached": True})
                return answer
            running = self._inflight.get(key)
            if running is not None:
                return running
            self._inflight[key] = answer
        try:
            self.queue.submit(client, answer,
                              lambda: self._build(key, spec, future, cached, waited_s, client),
                              lambda: self._overloaded(key, answer))
        except QueueFull:
            self._overloaded(key, answer)
        return answer

    def pending(self, spec: GrammarSpec, waited_s: float) -> dict:
        """The "compiling" report (GrammarChecker.pending); never kept."""
        return GrammarChecker.pending(spec, waited_s).as_dict()

    def stats(self) -> CheckStats:
        """The counters, with the queues' sizes now (the manager's compile queues too)."""
        with self._lock:
            return dataclasses.replace(
                queue_stats(self.guided, self.counts), reports_kept=len(self._kept),
                report_bytes=self._size, reports_waiting=self.queue.waiting,
                reports_running=self.queue.running)

    def close(self) -> None:
        for answer in self.queue.close():
            if not answer.done():
                answer.set_exception(GrammarUnavailable("the worker is shutting down"))

    # on the report thread ---------------------------------------------------------------------

    def _build(self, key: str, spec: GrammarSpec, future: Future, cached: bool,
               waited_s: float, client: str | None = None) -> dict:
        began = CLOCK()
        try:
            if self._checker is None:  # reads the vocabulary: once, here
                engine_search = self.guided.closer
                closer = CompletionSearch(self.guided.tokenizer_info, engine_search.encode,
                                          max_expansions=engine_search.max_expansions,
                                          time_limit_s=engine_search.time_limit_s)
                self._checker = GrammarChecker(self.guided, closer, self.budget_s)
            report = self._checker.report(spec, future, cached, waited_s).as_dict()
        except BaseException:
            with self._lock:
                self._inflight.pop(key, None)
            raise
        finally:
            cpu = CLOCK() - began
            self.meter.charge(client, cpu)
            with self._lock:
                self.counts.report_cpu_s += cpu
        compiled = None if future.exception() is not None else future.result()
        facts = compiled.facts.admission() if compiled is not None else None
        ttl = float("inf") if compiled is not None else self.guided.error_ttl_s
        with self._lock:
            self._inflight.pop(key, None)
            self.counts.reports += 1
            self._keep(key, _Kept(report, facts, len(json.dumps(report, default=str)),
                                  time.monotonic() + ttl))
        return report

    # inside the lock ----------------------------------------------------------------------------

    def _keep(self, key: str, kept: _Kept) -> None:
        old = self._kept.pop(key, None)
        self._size += kept.size - (old.size if old is not None else 0)
        self._kept[key] = kept
        while len(self._kept) > 1 and (len(self._kept) > self.max_reports
                                       or self._size > self.max_bytes):
            self._size -= self._kept.popitem(last=False)[1].size

    @staticmethod
    def _restore(kept: _Kept, future: Future) -> None:
        """Puts the report's admission facts back on a grammar compiled since."""
        if kept.facts is not None and future.done() and future.exception() is None:
            future.result().facts.adopt(kept.facts)

    def _overloaded(self, key: str, answer: Future) -> None:
        with self._lock:
            if self._inflight.get(key) is answer:
                del self._inflight[key]
            self.counts.reports_overloaded += 1
            waiting = self.queue.waiting
        if not answer.done():
            answer.set_exception(GrammarUnavailable(
                f"this worker has {waiting} grammar checks waiting (the limit is "
                f"{self.queue.limit}) and this client has its share of them; retry in a few "
                "seconds", ErrorKind.OVERLOADED))

