"""CompileMeter: what each client's grammar checks have cost this worker lately, so one
client's checks cannot keep a worker's cores on compiles while it serves others (issue 58:
a flood of ``POST /v1/grammars`` with distinct large schemas beside a polite client's
requests).

    meter = CompileMeter(share=0.1, burst_s=1.0)
    wait = meter.wait_s(client, busy=True)  # 0: it may start a compile now
    meter.begin(client)                     # a compile of its started ...
    meter.end(client, cost_s)               # ... and cost this many seconds

A leaky bucket of seconds: each compile a client's check started adds its cost (the
compile job's CPU in this worker process, and the report's CPU; a compile in the cache
actor or a child process is bounded by that queue's own fairness); the debt drains at
``share`` seconds a second, always.

- At most ``MAX_RUNNING`` of a client's compiles run at once.
- While the worker serves other clients' requests (``busy``: the caller says), a client may
  start one only while its debt, with each compile still running and the one asked for
  counted at the more of the client's recent mean compile cost (half of ``burst_s`` before
  its first compile ends: nobody knows the cost yet, so two start at once at first) and
  the time the running one has taken so far, is at most ``burst_s``, or nothing at all is
  owed (a compile that alone costs more than the burst). So one client's checks
  take about ``share`` of one core on average, and the rest (the engine thread, the
  replicas) is left to the requests.
- While it serves none, nobody is slowed: a client's checks may use what is idle.
A refused check is ``overloaded`` (a 429) with the wait in Retry-After.

Written here rather than taken from a rate-limit library: those charge a fixed cost when a
call is admitted, where a compile's cost is known only once it has run (0.1 ms for a
small schema, seconds for a large one), and the in-flight compiles must count meanwhile.
Thread-safe; at most ``max_clients`` kept (the longest idle forgotten first: a forgotten
client's debt had drained or it is only charged again).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

# a client's compiles for checks that may run at once on a worker, busy or not
MAX_RUNNING = 3
# how much a new cost moves a client's mean compile cost (the in-flight estimate)
_MEAN_WEIGHT = 0.5


@dataclass
class _Account:
    debt: float = 0.0  # seconds, as of ``at``
    at: float = 0.0
    running: list = field(default_factory=list)  # when each compile not yet charged began
    mean_cost: float = 0.0  # recent mean of its compiles' cost
    ended: int = 0  # compiles charged so far


class CompileMeter:
    def __init__(self, share: float = 0.1, burst_s: float = 1.0, max_clients: int = 4096,
                 clock=time.monotonic):
        if share <= 0 or burst_s < 0:
            raise ValueError(f"a CompileMeter needs share > 0 and burst_s >= 0 (got "
                             f"share={share}, burst_s={burst_s})")
        self.share = share
        self.burst_s = burst_s
        self.max_clients = max_clients
        self.clock = clock
        self.refusals = 0  # wait_s answers over 0
        self._accounts: OrderedDict[object, _Account] = OrderedDict()
        self._lock = threading.Lock()

    def wait_s(self, client, busy: bool = True) -> float:
        """Seconds before ``client`` may start a compile: 0 now, else at least 1 (while
        ``busy``, the time its debt and its running compiles' estimate take to drain to
        where the compile asked for fits in ``burst_s``). A positive answer is counted as
        a refusal."""
        with self._lock:
            acc = self._account(client, create=False)
            if acc is None:
                return 0.0
            owed = acc.debt
            if busy:
                # a compile's estimate: its recent mean, else (none has ended yet) half
                # the burst
                now = self.clock()
                floor = acc.mean_cost if acc.ended else self.burst_s / 2
                owed += sum(max(floor, now - began) for began in acc.running)
                # the compile asked for counts too, at the same estimate (one that alone
                # is over the burst starts once nothing is owed)
                if len(acc.running) < MAX_RUNNING and (
                        owed == 0 or owed + floor <= self.burst_s):
                    return 0.0
                self.refusals += 1
                return max(1.0, (owed - max(0.0, self.burst_s - floor)) / self.share)
            elif len(acc.running) < MAX_RUNNING:
                return 0.0
            self.refusals += 1
            return 1.0

    def begin(self, client) -> None:
        with self._lock:
            self._account(client).running.append(self.clock())

    def end(self, client, cost_s: float) -> None:
        """A compile ``begin`` counted has ended (or never ran: cost 0)."""
        with self._lock:
            acc = self._account(client)
            if acc.running:
                acc.running.pop(0)
            cost_s = max(0.0, cost_s)
            acc.mean_cost = (cost_s if not acc.ended
                             else acc.mean_cost + _MEAN_WEIGHT * (cost_s - acc.mean_cost))
            acc.ended += 1
            acc.debt += cost_s

    def charge(self, client, cost_s: float) -> None:
        """Adds work of ``client``'s that was not a compile (a report's CPU)."""
        with self._lock:
            self._account(client).debt += max(0.0, cost_s)

    def debt_s(self, client) -> float:
        with self._lock:
            acc = self._account(client, create=False)
            return 0.0 if acc is None else acc.debt

    # inside the lock ------------------------------------------------------------------

    def _account(self, client, create: bool = True) -> _Account | None:
        now = self.clock()
        acc = self._accounts.get(client)
        if acc is None:
            if not create:
                return None
            acc = self._accounts[client] = _Account(at=now)
            while len(self._accounts) > self.max_clients:
                self._accounts.popitem(last=False)
        acc.debt = max(0.0, acc.debt - (now - acc.at) * self.share)
        acc.at = now
        self._accounts.move_to_end(client)
        return acc
