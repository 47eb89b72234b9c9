"""The grammar cache's counters, one dataclass per component: incremented as typed fields
where they happen, turned into a dict (``as_dict``) only where they cross Ray, and rendered
to /metrics field by field (deploy/metrics.py), so a typo is an AttributeError, never a
silent zero, and a new field that /metrics does not export fails tests/unit/test_stats_unit.py.

- ``CacheStats``: the cluster-wide cache (the actor's ``GrammarCache``).
- ``DiskStats``: a node's disk tier (``DiskStore``), in the actor and in each worker.
- ``ClientStats``: a worker's cache client (``GrammarCacheClient``).
- ``ReplicationStats``: a worker's warm replication (``Replicator``).
- ``GrammarRequestStats``: a worker's guided requests and their waits for a grammar.
- ``CheckStats``: a worker's grammar-check reports (worker/guided/check_reports.py) and
  its own compile queue (worker/guided/compile_queue.py).

The worker reports the last four as one flat group (``rayguide_worker_grammar_client_*``);
their field names are distinct for that reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


class _Stats:
    def as_dict(self) -> dict:
        """The plain dict that crosses Ray (and JSON)."""
        return asdict(self)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass
class CacheStats(_Stats):
    hits: int = 0  # get() answered from memory
    misses: int = 0  # get() that had to compile (or join one)
    compiles: int = 0  # compiles run, a worker's lease counted as one
    errors: int = 0  # compiles that failed (the grammar's fault, or a limit)
    timeouts: int = 0  # ... past compile_timeout_s
    joined: int = 0  # get() that joined a compile already running
    local_verdicts: int = 0  # "compile it yourself": loading would take longer
    unavailable: int = 0  # compile process crashed or the cache could not answer
    disk_hits: int = 0  # loaded from the node's disk tier instead of compiled
    hot: int = 0  # grammars that turned hot (replicated to every worker)
    leases: int = 0  # first compiles handed to the asking worker
    lease_publishes: int = 0
    lease_releases: int = 0
    lease_lapses: int = 0  # leases whose holder never published (it died)
    late_publishes: int = 0  # published after the lease had lapsed
    too_large: int = 0  # refused before compiling (grammar_too_large)
    overloaded: int = 0  # refused: the compile queue was full
    displaced: int = 0  # queued compiles pushed out by another client's
    cancelled: int = 0  # compiles cancelled: no one waited for them any more


@dataclass
class DiskStats(_Stats):
    disk_hits: int = 0
    disk_misses: int = 0
    disk_writes: int = 0
    disk_evictions: int = 0
    disk_errors: int = 0


@dataclass
class ClientStats(_Stats):
    fetches: int = 0
    actor_hits: int = 0  # compiled grammars received from the actor
    verdicts: int = 0  # compiled in-process on the actor's word
    verdicts_in_child: int = 0
    verdict_timeouts: int = 0
    worker_compiles: int = 0  # first compiles under a lease
    worker_compile_timeouts: int = 0
    lease_releases: int = 0
    publishes: int = 0
    publish_failures: int = 0
    publish_s: float = 0.0
    publish_max_s: float = 0.0
    local_fallbacks: int = 0  # compiled without the actor
    actor_failures: int = 0
    registrations: int = 0
    registration_retries: int = 0
    unavailable: int = 0  # transient failures returned to the engine
    fetch_wait_s: float = 0.0  # total
    fetch_wait_max_s: float = 0.0
    disk_hits: int = 0  # loaded from this node's disk tier
    disk_writes: int = 0
    actor_skipped: bool = False  # the actor is skipped for a while after a failure (state)


@dataclass
class ReplicationStats(_Stats):
    prefetches: int = 0
    prefetch_failures: int = 0
    prefetch_skipped_budget: int = 0  # the worker's replicate_max_bytes was reached
    prefetch_deferred: int = 0  # requests were waiting for grammars: they go first
    prefetch_deferred_compiling: int = 0  # the actor was busy compiling
    prefetch_s: float = 0.0
    replication_polls: int = 0
    replication_poll_failures: int = 0
    replication_registrations: int = 0


@dataclass
class GrammarRequestStats(_Stats):
    grammar_requests: int = 0  # guided requests
    grammar_request_waits: int = 0  # ... whose grammar had to be fetched or compiled
    grammar_request_wait_s: float = 0.0
    grammar_request_wait_max_s: float = 0.0


@dataclass
class CheckStats(_Stats):
    reports: int = 0  # grammar-check reports built (each a grammar's closing searches)
    report_hits: int = 0  # checks answered from a kept report
    reports_overloaded: int = 0  # checks refused: the report queue was full
    reports_throttled: int = 0  # checks refused: their client's compile share was spent
    report_cpu_s: float = 0.0  # CPU the reports took on their own thread
    reports_kept: int = 0
    report_bytes: int = 0  # what the kept reports hold, as JSON
    reports_waiting: int = 0
    reports_running: int = 0
    compiles_waiting: int = 0  # the worker's own compile queue (FairQueue)
    compiles_running: int = 0
    compiles_refused: int = 0  # new grammars refused at once (queue full: OVERLOADED)
    compiles_displaced: int = 0  # waiting compiles that gave their place to a lighter client
