"""FairQueue: the grammar work a worker does on threads of its own (its manager's compiles:
llguidance builds, xgrammar compiles or fetches; the grammar check's reports), bounded and
shared fairly between clients, as the cache actor's CompileQueue shares its compile
processes (grammar_cache/actor.py).

    queue = FairQueue(threads=8, limit=32, name="grammar-compile")
    queue.submit(client, future, run, refused)  # QueueFull: full, and the client has its share

A job waits in its client's line; a free thread takes the head of the next line in turn
(round robin, first between tenants, then between a tenant's clients: core/fair_lines.py),
so a client with fifty jobs waiting holds another client's one back by one job at most,
and a tenant with fifty clients another tenant's one by one job at most. At most ``limit``
jobs wait: past it, a client of a tenant with fewer waiting than the tenant with the most
takes the place of that tenant's heaviest client's newest job (whose ``refused`` is
called: it was never run), as does a client with fewer than the heaviest of its own
tenant's, and any other ask is refused at once with QueueFull. ``drop``
takes a job nobody waits for any more out of its line. ``future`` gets ``run()``'s result
or exception. Thread-safe; ``refused`` runs outside the queue's lock.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from core.fair_lines import FairLines


class QueueFull(Exception):
    """The queue holds ``limit`` waiting jobs and the asking client has its share."""


@dataclass(eq=False)
class _Job:
    client: object
    future: Future
    run: Callable[[], object]
    refused: Callable[[], None]


class FairQueue:
    def __init__(self, threads: int, limit: int, name: str = "grammar-work"):
        if threads < 1 or limit < 1:
            raise ValueError(f"a FairQueue needs at least one thread and one place "
                             f"(got threads={threads}, limit={limit})")
        self.threads = threads
        self.limit = limit
        self.name = name
        self.running = 0  # jobs on a thread now
        self.refusals = 0  # asks refused at once (QueueFull)
        self.displaced = 0  # waiting jobs that gave their place to a lighter client's
        self._lines = FairLines()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._started = False
        self._closed = False

    def submit(self, client, future: Future, run: Callable[[], object],
               refused: Callable[[], None]) -> None:
        """Queues ``run`` for ``client``; ``future`` gets its result. Raises QueueFull
        (nothing queued) when ``limit`` jobs wait and ``client`` (and its tenant) already
        has as many waiting as the heaviest, less one (core/fair_lines.py)."""
        job = _Job(client, future, run, refused)
        victim = None
        with self._lock:
            if self._closed:
                raise QueueFull(f"the {self.name} queue is shut down")
            if self.waiting >= self.limit:
                found = self._lines.victim_for(client)
                if found is None:
                    self.refusals += 1
                    raise QueueFull()
                victim = self._take(*found)
                self.displaced += 1
            self._lines.add(client, job)
            self._start()
            self._ready.notify()
        if victim is not None:
            victim.refused()

    def drop(self, future: Future) -> bool:
        """Takes the job of ``future`` out of its line (nobody waits for it); False when
        it is not waiting (running, done, or never queued). Its future is left as is."""
        with self._lock:
            for client, job in self._lines.items():
                if job.future is future:
                    self._take(client, job)
                    return True
        return False

    def waiting_of(self, client) -> int:
        """How many of ``client``'s jobs wait."""
        with self._lock:
            return self._lines.count(client)

    def close(self) -> list[Future]:
        """Stops taking jobs; the threads end once the running jobs do. Returns the futures
        of the jobs that were still waiting (never run: the caller fails them)."""
        with self._lock:
            self._closed = True
            left = [job.future for _, job in self._lines.items()]
            self._lines.clear()
            self._ready.notify_all()
        return left

    # inside the lock ------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Jobs in the lines."""
        return self._lines.waiting

    def _take(self, client, job: _Job) -> _Job:
        self._lines.remove(client, job)
        return job

    def _next(self) -> _Job:
        return self._lines.pop()[1]  # round robin: tenants, then a tenant's clients

    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        for i in range(self.threads):
            threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True).start()

    # the threads ------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._lines and not self._closed:
                    self._ready.wait()
                if not self._lines:
                    return  # closed
                job = self._next()
                self.running += 1
            try:
                result = job.run()
            except BaseException as exc:  # noqa: BLE001 - the job's own failure, passed on
                if not job.future.done():
                    job.future.set_exception(exc)
            else:
                if not job.future.done():
                    job.future.set_result(result)
            finally:
                with self._lock:
                    self.running -= 1
