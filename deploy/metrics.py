"""The endpoint's metrics: request counters and latencies exported through Ray's metrics
agent (Prometheus format on each node's metrics port) and, with the runtime's gauges
(per worker, scheduler, grammar client), as Prometheus text on GET /metrics."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# a worker's prefix cache counters (the engine's stats): prompt tokens looked up, and of
# those found cached; exported for every worker, 0 from an engine that reports none
PREFIX_CACHE_COUNTERS = ("prefix_cache_query_tokens", "prefix_cache_hit_tokens")


@dataclass
class ReplicaStats:
    """This replica's own counts: ``rayguide_replica_http_requests{route, status}`` and
    ``rayguide_replica_generated_tokens``."""

    requests: dict[tuple[str, int], int] = field(default_factory=dict)
    generated_tokens: int = 0


class Metrics:
    """Request counters and latencies, exported through Ray's metrics agent (Prometheus
    format on each node's metrics port) and, together with the runtime's gauges, as
    Prometheus text on GET /metrics."""

    def __init__(self):
        from ray.util import metrics
        self.requests = metrics.Counter("rayguide_http_requests",
                                        "HTTP requests by route and status",
                                        tag_keys=("route", "status"))
        self.latency = metrics.Histogram("rayguide_http_request_seconds",
                                         "time to the response (to the stream start when "
                                         "streaming)", boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2,
                                                                   5, 10, 30, 60],
                                         tag_keys=("route",))
        self.first_token = metrics.Histogram("rayguide_time_to_first_token_seconds",
                                             "streamed requests: time to the first token",
                                             boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10])
        self.generated = metrics.Counter("rayguide_generated_tokens",
                                         "completion tokens sent to clients")
        self.local = ReplicaStats()

    def request(self, route: str, status: int, seconds: float) -> None:
        self.requests.inc(1, {"route": route, "status": str(status)})
        self.latency.observe(seconds, {"route": route})
        key = (route, status)
        self.local.requests[key] = self.local.requests.get(key, 0) + 1

    def ttft(self, seconds: float) -> None:
        self.first_token.observe(seconds)

    def tokens(self, n: int) -> None:
        if n > 0:  # Ray's Counter refuses 0 (an answer with no tokens: aborted, refused)
            self.generated.inc(n)
        self.local.generated_tokens += n

    def render(self, status: dict | None, client=None, cache: dict | None = None) -> str:
        """The Prometheus text of /metrics. ``status``: the scheduler's ``stats()`` (None:
        it did not answer): its counters as ``rayguide_scheduler_<name>``, and each
        worker's load report as ``rayguide_worker_<name>{worker=...}`` (engine stats, with
        ``prefix_cache_hit_rate``: hit / query tokens, absent before the first query),
        ``rayguide_worker_grammar_client_<name>`` (cache client, replication, grammar
        waits) and ``rayguide_worker_grammar_local_<name>`` (the worker's own LRU).
        ``client``: this replica's ``RuntimeClientStats`` (``rayguide_replica_<name>``).
        ``cache``: the grammar cache actor's ``stats()`` (``rayguide_grammar_cache_<name>``,
        its disk tier ``rayguide_grammar_cache_store_<name>``). Every number in them is
        exported under its field's name (the stats dataclasses: grammar_cache/stats.py,
        SchedulerStats, RuntimeClientStats, EngineStats; tests/unit/test_stats_unit.py)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
        reg = CollectorRegistry()
        if client is not None and not isinstance(client, dict):
            client = dataclasses.asdict(client)
        _gauges(reg, "rayguide_replica_", "this replica's runtime client", client or {})
        req = Counter("rayguide_replica_http_requests", "this replica's HTTP requests",
                      ("route", "status"), registry=reg)
        for (route, code), n in self.local.requests.items():
            req.labels(route, str(code)).inc(n)
        Counter("rayguide_replica_generated_tokens", "this replica's completion tokens",
                registry=reg).inc(self.local.generated_tokens)
        up = Gauge("rayguide_up", "1 when the scheduler answers", registry=reg)
        up.set(1 if status else 0)
        if status:
            Gauge("rayguide_sessions", "sessions pinned by the scheduler",
                  registry=reg).set(status["sessions"])
            Gauge("rayguide_workers", "workers registered", registry=reg).set(
                len(status["workers"]))
            _gauges(reg, "rayguide_scheduler_", "scheduler", status)
            groups = {"rayguide_worker_": (_with_prefix_hit_rate, {}),
                      "rayguide_worker_grammar_client_": (
                          lambda load: load.get("grammar_client") or {}, {}),
                      "rayguide_worker_grammar_local_": (
                          lambda load: load.get("grammar_cache") or {}, {})}
            for wid, load in status["workers"].items():
                for prefix, (part, gauges) in groups.items():
                    for name, value in _numbers(part(load)):
                        if name not in gauges:
                            gauges[name] = Gauge(f"{prefix}{name}", f"per worker: {name}",
                                                 ("worker",), registry=reg)
                        gauges[name].labels(wid).set(value)
        if cache:
            _gauges(reg, "rayguide_grammar_cache_", "grammar cache", cache)
            _gauges(reg, "rayguide_grammar_cache_store_", "grammar cache's disk tier",
                    cache.get("disk") or {})
        return generate_latest(reg).decode()


def _with_prefix_hit_rate(load: dict) -> dict:
    """A worker's load report with its prefix cache counters (0 when absent) and their
    ratio, ``prefix_cache_hit_rate`` (left out while nothing was looked up: no series beats
    a made-up 0)."""
    counts = {name: load.get(name, 0) for name in PREFIX_CACHE_COUNTERS}
    query, hit = counts["prefix_cache_query_tokens"], counts["prefix_cache_hit_tokens"]
    rate = {"prefix_cache_hit_rate": hit / query} if query else {}
    return {**load, **counts, **rate}


def _numbers(values: dict):
    """The (name, value) pairs of a stats dict that are numbers (a flag as 0 / 1); nested
    groups, lists, text and None are left to their own renderers."""
    for name, value in values.items():
        if isinstance(value, (int, float)):  # bool is an int: a flag exports as 0 / 1
            yield name, float(value)


def _gauges(reg, prefix: str, what: str, values: dict) -> None:
    from prometheus_client import Gauge
    for name, value in _numbers(values):
        Gauge(f"{prefix}{name}", f"{what}: {name}", registry=reg).set(value)
