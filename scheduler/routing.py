"""The scheduler's tables, without Ray: which workers exist and how loaded they are, which
worker each session lives on, which prompt prefixes each was sent, and the routing rule.

A worker's load is its queued + running tokens, counting what was routed to it since its
last load report (so a burst spreads before the next report), less what of that has ended
since (``finished``: clients report the requests that ended with their next route, each
with the report epoch it was routed in; one routed before the last report is counted by
that report, or had ended by then). Without it a burst of short requests between two
reports piled up on the workers they went to, as if none had ended, and pushed a prefix's
requests off the worker that holds it. ``route`` picks, in order:

1. **session**: a live session's worker (its KV is there); refused (Overloaded) when that
   worker is over ``max_queued_tokens`` (sticky routing must not let one session queue
   unbounded work);
2. **prefix**: among the live workers within ``prefix_margin_tokens`` of the least loaded
   (and under the queue limit), the one that was sent the longest prefix of the prompt
   (``prefix_keys``, core/prefix_keys.py: at least one chunk; ties: the less loaded);
3. **grammar**: among the live workers within ``affinity_margin_tokens`` of the least
   loaded, one holding the request's grammar (below);
4. **load**: the least loaded live worker.

"Live" leaves out suspect workers (and those in ``avoid``) while another answers. The
margins bound what affinity may cost: a popular prefix's holder takes its requests until it
is a margin past the least loaded, then the next one spills to the least loaded, which
holds the prefix from then on; the prefix ends up on as many workers as its traffic needs,
and none is sent a request for its prefix while it is more than a margin above the least
loaded. The table remembers the last ``PREFIX_KEYS_PER_WORKER`` keys it routed to each
worker (the shortest prefixes last to go, as the engine's cache keeps them); a dropped or
re-registered worker (a restart: its cache is gone) holds none. ``prefix_routes`` counts
the requests step 2 placed.

When every live worker is over its queue limit the answer is Overloaded (HTTP 429 later),
never an unbounded queue; with no live worker it is NoWorkers (503).

Live sessions are capped per worker and in total (each holds KV on its worker and rides
every load report): a new session over a cap is TooManySessions (an Overloaded: 429).

A grammar check is routed as a request of ``CHECK_COST_TOKENS`` tokens, and the checks a
worker reports queued count as that many each.

Grammar affinity: a new guided request names its grammar's family (the tokenizer-independent
part of its key). A worker holds it when it reports it in its load (``grammar_families``)
or the table sent it there since that report, so a request does not wait for a grammar
another worker already has compiled. Not for a grammar a worker reports as cheap
(llguidance serves it: a compile of about a millisecond, where affinity would only put
every request of a popular grammar into one worker's batch).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from core.errors import NoWorkers, Overloaded, TooManySessions

# what one grammar check (POST /v1/grammars) counts as, in queued tokens: its report's
# closing searches (REPORT_CPU_S, worker/guided/check_reports.py) cost about what decoding
# this many tokens costs a small model, so checks count against a worker's queue limit
# (a flood of them is Overloaded) and spread over workers as requests do
CHECK_COST_TOKENS = 512
# prefix keys remembered per worker: 64 prompts of the longest keyed length (16k characters),
# far more of the short shared instructions that prefix routing is for; fewer where the
# worker's KV cache holds less (its load report's total_blocks and block_size, a key
# standing for about PREFIX_KEY_TOKENS tokens): what the table believes a worker holds
# then ages out about when the worker's own LRU cache lets it go
PREFIX_KEYS_PER_WORKER = 4096
PREFIX_KEY_TOKENS = 64


@dataclass
class WorkerEntry:
    worker_id: str
    handle: object
    node_id: str = ""
    load: dict = field(default_factory=dict)
    routed_since_report: int = 0  # tokens routed here since the last load report, still running
    reports: int = 0  # load reports so far: the epoch a route answers with (see finished)
    last_report: float = 0.0
    families_since_report: set = field(default_factory=set)  # grammars sent here since
    # missed a load poll, or a caller saw a call fail, and the worker is not known dead:
    # new work goes elsewhere while any other worker answers; the next report clears it
    suspect: bool = False
    # prefix keys routed here, least recently first (a prompt's shortest prefix the newest)
    prefixes: OrderedDict = field(default_factory=OrderedDict)

    def holds(self, family: str) -> bool:
        return family in self.families_since_report or family in self.load.get(
            "grammar_families", ())

    def prefix_match(self, keys: list[str]) -> int:
        """How many leading chunks of a prompt with these keys were sent here: one past the
        longest of its keys this worker holds (each key names its whole prefix); 0: none."""
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] in self.prefixes:
                return i + 1
        return 0

    def remember_prefix(self, keys: list[str]) -> None:
        for key in reversed(keys):  # the shortest prefix is the last to be forgotten
            self.prefixes[key] = None
            self.prefixes.move_to_end(key)
        while len(self.prefixes) > self.prefix_capacity:
            self.prefixes.popitem(last=False)

    @property
    def prefix_capacity(self) -> int:
        """How many prefix keys this worker's KV cache could hold (PREFIX_KEYS_PER_WORKER
        before its first load report)."""
        blocks = self.load.get("total_blocks")
        if not blocks:
            return PREFIX_KEYS_PER_WORKER
        tokens = blocks * self.load.get("block_size", 16)
        return max(1, min(PREFIX_KEYS_PER_WORKER, tokens // PREFIX_KEY_TOKENS))

    @property
    def queued_tokens(self) -> int:
        return (self.load.get("running_tokens", 0) + self.load.get("waiting_tokens", 0)
                + CHECK_COST_TOKENS * self.load.get("checks_queued", 0)
                + self.routed_since_report)


class RoutingTable:
    def __init__(self, max_queued_tokens: int = 65536, session_idle_timeout_s: float = 600.0,
                 affinity_margin_tokens: int = 2048, max_sessions_per_worker: int = 1024,
                 max_sessions: int = 16384, prefix_margin_tokens: int = 4096):
        self.max_queued_tokens = max_queued_tokens
        self.max_sessions_per_worker = max_sessions_per_worker
        self.max_sessions = max_sessions
        self.affinity_margin_tokens = affinity_margin_tokens
        self.affinity_routes = 0  # new requests sent to a worker for its grammar
        self.prefix_margin_tokens = prefix_margin_tokens
        self.prefix_routes = 0  # requests sent to a worker for their prompt's prefix
        self.session_idle_timeout_s = session_idle_timeout_s
        self.workers: dict[str, WorkerEntry] = {}
        self.sessions: dict[str, tuple[str, float]] = {}  # session -> (worker, last used)
        self.sessions_on: Counter[str] = Counter()  # worker -> sessions pinned to it

    def add_worker(self, worker_id: str, handle, node_id: str = "") -> None:
        """Registers (or re-registers, after a restart) a worker: it holds no prefix."""
        self.workers[worker_id] = WorkerEntry(worker_id, handle, node_id,
                                              last_report=time.monotonic())

    def drop_worker(self, worker_id: str) -> list[str]:
        """Removes a dead worker; returns the sessions that were pinned to it (they are
        routed afresh next time and their KV is recomputed there)."""
        self.workers.pop(worker_id, None)
        orphans = [s for s, (w, _) in self.sessions.items() if w == worker_id]
        for s in orphans:
            self._unpin(s)
        return orphans

    def suspect(self, worker_id: str) -> None:
        """The worker did not answer in time (busy, or dying): routed around until its next
        load report, but kept, with its sessions: a slow worker is not a dead one."""
        entry = self.workers.get(worker_id)
        if entry is not None:
            entry.suspect = True

    def update_load(self, worker_id: str, load: dict) -> None:
        entry = self.workers.get(worker_id)
        if entry is not None:
            for k in ("grammar_families", "cheap_grammar_families"):  # sets: membership
                if k in load:  # tests on every route
                    load = {**load, k: frozenset(load[k])}
            entry.load = load
            entry.suspect = False
            entry.routed_since_report = 0
            entry.reports += 1
            entry.families_since_report = set()
            entry.last_report = time.monotonic()

    def finished(self, done) -> None:
        """Requests that ended, as (worker_id, epoch, expected tokens): each routed since
        its worker's last load report (the same epoch) no longer counts in its load."""
        for worker_id, epoch, tokens in done:
            entry = self.workers.get(worker_id)
            if entry is not None and entry.reports == epoch:
                entry.routed_since_report = max(0, entry.routed_since_report - tokens)

    def route(self, session_id: str | None, expected_tokens: int = 256,
              grammar_family: str | None = None,
              avoid: frozenset[str] = frozenset(),
              prefix_keys: list[str] | None = None) -> WorkerEntry:
        """The worker for this request, by the module's rule. ``avoid``: workers the
        request already died on, chosen only when no other worker is registered. (When
        every worker is suspect, the least loaded would otherwise win, and that is often the
        one just killed and restarting: its queue is empty.) ``prefix_keys``: the prompt's
        (core/prefix_keys.py), remembered for the worker chosen."""
        now = time.monotonic()
        if session_id is not None and session_id in self.sessions:
            worker_id, _ = self.sessions[session_id]
            entry = self.workers.get(worker_id)
            if entry is not None and not entry.suspect and worker_id not in avoid:
                if self._over_limit(entry, expected_tokens):
                    raise Overloaded(f"the worker holding session_id {session_id[:80]!r} has over "
                                     f"{self.max_queued_tokens} tokens queued; retry later")
                self.sessions[session_id] = (worker_id, now)
                entry.routed_since_report += expected_tokens
                entry.remember_prefix(prefix_keys or [])
                return entry
        if not self.workers:
            raise NoWorkers("no worker is alive; the runtime is starting or every worker died")
        if session_id is not None and session_id not in self.sessions \
                and len(self.sessions) >= self.max_sessions:
            raise TooManySessions(
                f"session_id {session_id[:80]!r} would be a new session, and {len(self.sessions)} "
                f"are live (the limit is {self.max_sessions}); end one (DELETE "
                "/v1/sessions/{id}), send without session_id, or retry later")
        # suspects only when no worker answers: a slow worker beats a 503
        pool = [w for w in self.workers.values() if w.worker_id not in avoid] or list(
            self.workers.values())
        live = [w for w in pool if not w.suspect] or pool
        if session_id is not None:  # a new (or moving) session: a worker with room for it
            live = [w for w in live if self.sessions_on[w.worker_id]
                    < self.max_sessions_per_worker]
            if not live:
                raise TooManySessions(
                    f"session_id {session_id[:80]!r} would be a new session on a worker, and every "
                    f"worker holds {self.max_sessions_per_worker} live sessions; end one "
                    "(DELETE /v1/sessions/{id}), send without session_id, or retry later")
        best = min(live, key=lambda w: (w.queued_tokens, w.worker_id))
        holder = self._prefix_holder(live, best, expected_tokens, prefix_keys or [])
        if holder is not None:
            best = holder
            self.prefix_routes += 1
        elif grammar_family is not None and not best.holds(grammar_family) \
                and not self._cheap(grammar_family, live):
            holders = [w for w in live if w.holds(grammar_family)
                       and w.queued_tokens <= best.queued_tokens + self.affinity_margin_tokens
                       and not self._over_limit(w, expected_tokens)]
            if holders:
                best = min(holders, key=lambda w: (w.queued_tokens, w.worker_id))
                self.affinity_routes += 1
        if self._over_limit(best, expected_tokens):
            raise Overloaded(f"every worker has over {self.max_queued_tokens} tokens queued; "
                             "retry later")
        best.routed_since_report += expected_tokens
        if grammar_family is not None:
            best.families_since_report.add(grammar_family)
        best.remember_prefix(prefix_keys or [])
        if session_id is not None:
            self._unpin(session_id)  # a session moving off a dead or slow worker
            self._pin(session_id, best.worker_id, now)
        return best

    def _prefix_holder(self, live: list[WorkerEntry], least: WorkerEntry,
                       expected_tokens: int, keys: list[str]) -> WorkerEntry | None:
        """Among the workers within ``prefix_margin_tokens`` of ``least`` and under the
        queue limit, the one holding the longest prefix of ``keys`` (ties: the less
        loaded); None when none holds a chunk of it."""
        if not keys:
            return None
        bound = least.queued_tokens + self.prefix_margin_tokens
        near = [w for w in live if w.queued_tokens <= bound
                and not self._over_limit(w, expected_tokens)]
        if not near:
            return None
        match, _, _, holder = min((-w.prefix_match(keys), w.queued_tokens, w.worker_id, w)
                                  for w in near)
        return holder if match < 0 else None

    @staticmethod
    def _cheap(family: str, workers: list[WorkerEntry]) -> bool:
        """A worker reported that llguidance serves this grammar there (it compiles in
        about a millisecond): affinity would only pile its requests onto one batch."""
        return any(family in w.load.get("cheap_grammar_families", ()) for w in workers)

    def _over_limit(self, entry: WorkerEntry, expected_tokens: int) -> bool:
        # an idle worker takes any request: a large max_tokens is a budget, not a queue,
        # and refusing it on an idle cluster would make a retrying client spin forever
        return bool(entry.queued_tokens) and \
            entry.queued_tokens + expected_tokens > self.max_queued_tokens

    def _pin(self, session_id: str, worker_id: str, now: float) -> None:
        self.sessions[session_id] = (worker_id, now)
        self.sessions_on[worker_id] += 1

    def _unpin(self, session_id: str) -> bool:
        pinned = self.sessions.pop(session_id, None)
        if pinned is None:
            return False
        self.sessions_on[pinned[0]] -= 1
        if self.sessions_on[pinned[0]] <= 0:
            del self.sessions_on[pinned[0]]
        return True

    def end_session(self, session_id: str) -> bool:
        return self._unpin(session_id)

    def idle_sessions(self) -> list[str]:
        """Sessions unused for longer than the idle timeout (to be ended)."""
        limit = time.monotonic() - self.session_idle_timeout_s
        return [s for s, (_, used) in self.sessions.items() if used < limit]

    def restore_sessions(self, worker_id: str, session_ids: list[str]) -> None:
        """After a scheduler restart: pins the sessions a worker reports holding."""
        now = time.monotonic()
        for s in session_ids:
            if s not in self.sessions:  # over a cap too: they already exist on the worker
                self._pin(s, worker_id, now)
