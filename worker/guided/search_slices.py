"""The closing searches' share of the engine thread: sliced, bounded per step.

A completion search (closing.py) can take seconds on a grammar whose shortest answer is long.
Run inline on the engine thread it stalls every row of the batch; run on another Python
thread it takes the GIL from the engine thread in 5 ms slices at each of the hundreds of
times a step releases it (a torch call), which stalls the batch as surely. So a search runs
on the engine thread, in a greenlet, in slices: each step gives all pending searches
together at most ``share`` of the engine's own recent step time (at least ``floor_ms``),
and a search whose slice is spent is suspended where it checks its clock (``due``) and
resumed next step. The row that asked waits for its answer (the output policy parks it:
it is not scheduled and its state does not change), so a late search costs that row's
latency alone; the other rows step as fast as without it.

    slices = SearchSlices(share=0.5, floor_ms=5.0)
    slices.begin_step()                  # once per engine step: this step's budget
    finished = slices.advance()          # pending searches resumed; owners whose ended
    got = slices.run(key, owner, fn)     # Done(value) now, or None: pending (asked again
                                         # later under the same key, it returns the value)
    slices.due()                         # from inside a search: suspends it when its
                                         # slice is spent; returns the CPU time it was away

Time is the engine thread's CPU time (``CLOCK``), as the searches' own caps are, so a
search's verdict does not depend on how busy the machine is; the time a search spends
suspended is given back to its caps (``due``'s return value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable

import greenlet

from worker.guided import closing


@dataclass
class Done:
    """A finished search's value and the engine-thread CPU time it took."""

    value: Any
    cpu_s: float


class _Job:
    __slots__ = ("key", "owners", "let", "done", "cpu_s")

    def __init__(self, key: Hashable, owner: Hashable, fn: Callable[[], Any]):
        self.key, self.owners = key, {owner}
        self.let = greenlet.greenlet(fn)
        self.done: Done | None = None
        self.cpu_s = 0.0


@dataclass
class SliceStats:
    """Counters of the sliced searches (the engine's stats)."""

    searches_sliced: int = 0  # searches that did not end within the step that asked
    search_slices: int = 0  # slices run in later steps
    search_cpu_ms: int = 0  # engine-thread CPU time spent in searches
    search_step_max_ms: int = 0  # the most any one step spent in searches


class SearchSlices:
    def __init__(self, share: float = 0.5, floor_ms: float = 5.0):
        self.share, self.floor_s = share, floor_ms / 1000
        self.stats = SliceStats()
        self._jobs: dict[Hashable, _Job] = {}
        self._step_s = 0.0  # moving average of a step's CPU time without searches
        self._began: float | None = None  # CPU clock at this step's start
        self._spent = 0.0  # searches' CPU time in this step
        self._left = self.floor_s  # what this step's searches may still take
        self._slice_end = float("inf")  # while a search runs: when it must yield
        self._running: _Job | None = None
        self._cpu_s = 0.0

    @property
    def budget_s(self) -> float:
        """A step's search budget: ``share`` of the engine's own recent step time, at
        least ``floor_ms``."""
        return max(self.floor_s, self.share * self._step_s)

    def begin_step(self) -> None:
        """A new step: the last one's time (less its searches) updates the average, and
        this one's budget is set."""
        now = closing.CLOCK()
        if self._began is not None:
            own = max(0.0, now - self._began - self._spent)
            self._step_s = own if self._step_s == 0.0 else 0.9 * self._step_s + 0.1 * own
        self._began, self._spent, self._left = now, 0.0, self.budget_s

    @property
    def pending(self) -> bool:
        return any(j.done is None for j in self._jobs.values())

    def __contains__(self, key: Hashable) -> bool:
        return key in self._jobs

    def run(self, key: Hashable, owner: Hashable,
            fn: Callable[[], Any] | None) -> Done | None:
        """The value of the search ``fn`` known by ``key``: at once when it ends within
        what is left of this step's budget (or ended since it was asked: it is handed
        over once and forgotten), else None (pending: it goes on in later steps; ask
        again under the same key, ``fn`` may then be None). Several owners may wait on
        one key."""
        job = self._jobs.get(key)
        if job is None:
            job = self._jobs[key] = _Job(key, owner, fn)
            self._resume(job)
            if job.done is None:
                self.stats.searches_sliced += 1
        job.owners.add(owner)
        if job.done is None:
            return None
        del self._jobs[key]
        if isinstance(job.done.value, _Failed):
            raise job.done.value.exc
        return job.done

    def ready(self, key: Hashable) -> bool:
        """Whether the search known by ``key`` has ended (or was never asked)."""
        job = self._jobs.get(key)
        return job is None or job.done is not None

    def advance(self) -> set[Hashable]:
        """Resumes pending searches, oldest first, within what is left of this step's
        budget; returns the owners of those that ended."""
        ended: set[Hashable] = set()
        for job in list(self._jobs.values()):
            if self._left <= 0:
                break
            if job.done is None:
                self.stats.search_slices += 1
                self._resume(job)
                if job.done is not None:
                    ended |= job.owners
        return ended

    def drop(self, owner: Hashable) -> None:
        """``owner`` waits no more (its request ended): a search nobody else waits for is
        thrown away."""
        for key, job in list(self._jobs.items()):
            job.owners.discard(owner)
            if not job.owners:
                self.cancel(key)

    def cancel(self, key: Hashable) -> None:
        """Throws the search known by ``key`` away (killed where it was suspended)."""
        job = self._jobs.pop(key, None)
        if job is not None and job.let:  # started, not ended
            job.let.throw(greenlet.GreenletExit)

    def due(self) -> float:
        """Called by a running search where it may stop: when its slice is spent it is
        suspended here until a later step resumes it; returns the CPU time it was away
        (0.0: it was not suspended)."""
        if self._running is None or closing.CLOCK() < self._slice_end:
            return 0.0
        away = closing.CLOCK()
        self._running.let.parent.switch()
        return closing.CLOCK() - away

    def _resume(self, job: _Job) -> None:
        if self._left <= 0:
            return
        outer = self._running, self._slice_end
        start = closing.CLOCK()
        self._running, self._slice_end = job, start + self._left
        try:
            value = job.let.switch()
        except Exception as exc:  # the search's own error: its owners get it (run)
            value = _Failed(exc)
        finally:
            self._running, self._slice_end = outer
            took = closing.CLOCK() - start
            job.cpu_s += took
            self._spent += took
            self._left -= took
            self.stats.search_step_max_ms = max(self.stats.search_step_max_ms,
                                                int(self._spent * 1000))
            self._cpu_s += took
            self.stats.search_cpu_ms = int(self._cpu_s * 1000)
        if job.let.dead:
            job.done = Done(value, job.cpu_s)


class _Failed:
    """A search that raised: ``run`` raises it again for the owner that asks."""

    def __init__(self, exc: Exception):
        self.exc = exc
