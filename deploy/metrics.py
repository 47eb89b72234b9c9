"""The endpoint's metrics: request counters and latencies exported through Ray's metrics
agent (Prometheus format on each node's metrics port) and, with the runtime's gauges
(per worker, scheduler, grammar client), as Prometheus text on GET /metrics."""

from __future__ import annotations


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
        self.local = {"requests": {}, "tokens": 0}

    def request(self, route: str, status: int, seconds: float) -> None:
        self.requests.inc(1, {"route": route, "status": str(status)})
        self.latency.observe(seconds, {"route": route})
        key = (route, status)
        self.local["requests"][key] = self.local["requests"].get(key, 0) + 1

    def ttft(self, seconds: float) -> None:
        self.first_token.observe(seconds)

    def tokens(self, n: int) -> None:
        self.generated.inc(n)
        self.local["tokens"] += n

    def render(self, status: dict | None, client: dict | None = None) -> str:
        """``status``: the scheduler's stats (None: it did not answer); ``client``: this
        replica's RuntimeClient.stats() (failovers, own routes while the scheduler
        restarted)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
        reg = CollectorRegistry()
        for name, value in (client or {}).items():
            Gauge(f"rayguide_replica_{name}", f"this replica's runtime client: {name}",
                  registry=reg).set(value)
        req = Counter("rayguide_replica_http_requests", "this replica's HTTP requests",
                      ("route", "status"), registry=reg)
        for (route, code), n in self.local["requests"].items():
            req.labels(route, str(code)).inc(n)
        Counter("rayguide_replica_generated_tokens", "this replica's completion tokens",
                registry=reg).inc(self.local["tokens"])
        up = Gauge("rayguide_up", "1 when the scheduler answers", registry=reg)
        up.set(1 if status else 0)
        if status:
            Gauge("rayguide_sessions", "sessions pinned by the scheduler",
                  registry=reg).set(status["sessions"])
            Gauge("rayguide_workers", "workers registered", registry=reg).set(
                len(status["workers"]))
            per = {name: Gauge(f"rayguide_worker_{name}", f"per worker: {name}",
                               ("worker",), registry=reg)
                   for name in ("running", "waiting", "free_blocks", "total_blocks",
                                "live_sessions", "live_processors")}
            # the worker's grammar cache client (actor hits, disk hits, local fallbacks,
            # prefetches, requests that waited for their grammar) and its local LRU of
            # compiled grammars (hits, misses, evictions; prefetches count as lookups)
            groups = {"grammar_client": ("rayguide_worker_grammar_client_", {}),
                      "grammar_cache": ("rayguide_worker_grammar_local_", {})}
            for wid, load in status["workers"].items():
                for name, gauge in per.items():
                    if isinstance(load.get(name), (int, float)):
                        gauge.labels(wid).set(load[name])
                for field, (prefix, gauges) in groups.items():
                    for name, value in (load.get(field) or {}).items():
                        if isinstance(value, (int, float)) and not isinstance(value, bool):
                            if name not in gauges:
                                gauges[name] = Gauge(f"{prefix}{name}",
                                                     f"per worker {field}: {name}",
                                                     ("worker",), registry=reg)
                            gauges[name].labels(wid).set(value)
            for name in ("routes", "rejected", "sessions_ended", "broadcast_messages",
                         "workers_dropped", "workers_suspected", "broadcast_failures",
                         "affinity_routes"):
                Gauge(f"rayguide_scheduler_{name}", f"scheduler: {name} so far",
                      registry=reg).set(status.get(name, 0))
        return generate_latest(reg).decode()
