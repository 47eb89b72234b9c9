"""Every field of every stats dataclass reaches /metrics under its own name: each layer's
counters (grammar_cache/stats.py, SchedulerStats, EngineStats, RuntimeClientStats) are
given made-up values, carried the way the runtime carries them (the worker's load report
inside the scheduler's stats, the cache actor's stats, the replica's client) and rendered
by deploy/metrics.py; a counter added to a dataclass and not exported fails here. And the
tree's one percentile and one backoff."""

import asyncio
import dataclasses
import itertools
import math
import statistics
import types
from types import SimpleNamespace

import pytest

from cluster.client import RuntimeClient, RuntimeClientStats
from deploy.metrics import Metrics, ReplicaStats
from core.backoff import backoff
from core.percentile import percentile
from grammar_cache.stats import (CacheStats, CheckStats, ClientStats, DiskStats,
                                 GrammarRequestStats, ReplicationStats)
from scheduler.actor import SchedulerStats, _shown
from worker.actor import grammar_report
from worker.engine.engine import EngineStats

pytestmark = pytest.mark.unit

# EngineStats fields that are not numbers: rendered as their own group, or not metrics
ENGINE_NOT_GAUGES = {"grammar_cache", "session_ids"}
_values = itertools.count(3)


def made_up(cls, skip=()):
    """An instance of a stats dataclass with a distinct value in every numeric field."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        assert kind in ("int", "float", "bool"), f"{cls.__name__}.{f.name}: {kind}"
        values[f.name] = True if kind == "bool" else next(_values) + (0.5 if kind == "float"
                                                                       else 0)
    return cls(**values)


def metrics() -> Metrics:
    m = Metrics.__new__(Metrics)  # no Ray metrics agent: only the text is rendered here
    m.local = ReplicaStats(requests={("chat", 200): 7}, generated_tokens=11)
    return m


def sample(text: str, name: str, value, worker: str | None = None) -> bool:
    labels = f'{{worker="{worker}"}}' if worker else ""
    return f"{name}{labels} {float(value)!r}\n" in text


@pytest.fixture(scope="module")
def rendered():
    engine = made_up(EngineStats, skip=ENGINE_NOT_GAUGES)
    engine = dataclasses.replace(engine, grammar_cache={"hits": 5}, session_ids=["s"])
    client, replication, requests, checks = (
        made_up(ClientStats), made_up(ReplicationStats), made_up(GrammarRequestStats),
        made_up(CheckStats))
    load = {**dataclasses.asdict(engine), "worker_id": "w0", "grammar_families": ["f"],
            "grammar_client": grammar_report(client.as_dict(), replication.as_dict(),
                                             requests.as_dict(), checks.as_dict())}
    entry = SimpleNamespace(node_id="n", suspect=False, load=load)
    scheduler = made_up(SchedulerStats)
    status = {**dataclasses.asdict(scheduler), "rebuild_s": None, "config": {},
              "workers": {"w0": _shown(entry)}}
    cache, disk = made_up(CacheStats), made_up(DiskStats)
    cache_stats = {**cache.as_dict(), "entries": 2, "disk": disk.as_dict(), "config": {}}
    runtime = RuntimeClient(scheduler=object())
    runtime.counts = made_up(RuntimeClientStats)
    runtime.failover_pauses.extend([0.25, 0.75])
    text = metrics().render(status, runtime.stats(), cache_stats)
    return SimpleNamespace(text=text, engine=engine, client=client, replication=replication,
                           requests=requests, checks=checks, scheduler=scheduler, cache=cache, disk=disk,
                           runtime=runtime.stats())


def test_every_engine_field_is_a_worker_gauge(rendered):
    for f in dataclasses.fields(EngineStats):
        if f.name not in ENGINE_NOT_GAUGES:
            assert sample(rendered.text, f"rayguide_worker_{f.name}",
                          getattr(rendered.engine, f.name), "w0"), f.name
    assert sample(rendered.text, "rayguide_worker_grammar_local_hits", 5, "w0")


@pytest.mark.parametrize("part", ["client", "replication", "requests", "checks"])
def test_every_grammar_client_field_is_a_worker_gauge(rendered, part):
    stats = getattr(rendered, part)
    for name, value in stats.as_dict().items():
        assert sample(rendered.text, f"rayguide_worker_grammar_client_{name}", value,
                      "w0"), name


def test_the_grammar_group_has_every_series_without_a_shared_cache():
    report = grammar_report(None, None, GrammarRequestStats().as_dict())
    assert set(report) == (set(ClientStats.names()) | set(ReplicationStats.names())
                           | set(GrammarRequestStats.names()) | set(CheckStats.names()))


def test_every_scheduler_field_is_exported(rendered):
    for name, value in dataclasses.asdict(rendered.scheduler).items():
        assert sample(rendered.text, f"rayguide_scheduler_{name}", value), name
    assert sample(rendered.text, "rayguide_sessions", rendered.scheduler.sessions)
    assert sample(rendered.text, "rayguide_workers", 1) and "rayguide_up 1.0" in rendered.text


def test_every_cache_and_disk_field_is_exported(rendered):
    for name, value in rendered.cache.as_dict().items():
        assert sample(rendered.text, f"rayguide_grammar_cache_{name}", value), name
    for name, value in rendered.disk.as_dict().items():
        assert sample(rendered.text, f"rayguide_grammar_cache_store_{name}", value), name


def test_every_runtime_client_field_is_exported(rendered):
    assert rendered.runtime.failover_pause_p50_s == 0.5
    assert rendered.runtime.failover_pause_max_s == 0.75
    for name, value in dataclasses.asdict(rendered.runtime).items():
        assert sample(rendered.text, f"rayguide_replica_{name}", value), name
    assert 'rayguide_replica_http_requests_total{route="chat",status="200"} 7.0' in rendered.text
    assert "rayguide_replica_generated_tokens_total 11.0" in rendered.text


def test_a_scheduler_that_does_not_answer_renders_the_replica_alone():
    text = metrics().render(None, RuntimeClientStats())
    assert "rayguide_up 0.0" in text and "rayguide_replica_failovers 0.0" in text
    assert "rayguide_worker_" not in text and "rayguide_scheduler_" not in text


def test_each_worker_has_its_prefix_cache_counters_and_hit_rate():
    """Every worker gets the two prefix cache counters (0 from an engine without them) and,
    once it looked a prompt up, their ratio; the scheduler its prefix_routes."""
    workers = {"w0": {"prefix_cache_query_tokens": 4000, "prefix_cache_hit_tokens": 3000},
               "w1": {"prefix_cache_query_tokens": 0, "prefix_cache_hit_tokens": 0},
               "w2": {"running_tokens": 5}}
    status = {**dataclasses.asdict(SchedulerStats(routes=9, prefix_routes=7)),
              "workers": workers}
    text = metrics().render(status)
    assert sample(text, "rayguide_worker_prefix_cache_hit_rate", 0.75, "w0")
    assert 'rayguide_worker_prefix_cache_hit_rate{worker="w1"}' not in text
    assert 'rayguide_worker_prefix_cache_hit_rate{worker="w2"}' not in text
    for worker, query, hit in (("w0", 4000, 3000), ("w1", 0, 0), ("w2", 0, 0)):
        assert sample(text, "rayguide_worker_prefix_cache_query_tokens", query, worker)
        assert sample(text, "rayguide_worker_prefix_cache_hit_tokens", hit, worker)
    assert sample(text, "rayguide_scheduler_prefix_routes", 7)


class _Remote:
    """A fake actor method: ``.remote()`` answers ``answer`` after ``delay_s`` (an
    exception is raised instead)."""

    def __init__(self, answer, delay_s=0.0):
        self.answer, self.delay_s = answer, delay_s

    async def remote(self):
        await asyncio.sleep(self.delay_s)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def served_metrics(cache_stats: _Remote) -> tuple[str, object]:
    """The /metrics page of a front end whose cache actor answers as ``cache_stats`` does
    (the real handler; the scheduler answers, the cache handle is a fake)."""
    import deploy.serve_app as serve_app
    cls = getattr(serve_app.OpenAIServer, "func_or_class", serve_app.OpenAIServer)
    server = SimpleNamespace(
        settings=SimpleNamespace(public_metrics=True, scheduler_timeout_s=0.2),
        runtime=RuntimeClient(scheduler=SimpleNamespace(
            stats=_Remote({**dataclasses.asdict(SchedulerStats()), "workers": {}}))),
        _metrics=metrics(), _cache=SimpleNamespace(stats=cache_stats))
    server._cache_stats = types.MethodType(cls._cache_stats, server)
    response = asyncio.run(cls.metrics(server, None))
    return response.body.decode(), server._cache


def test_metrics_page_has_the_cache_actors_series():
    cache, disk = made_up(CacheStats), made_up(DiskStats)
    text, handle = served_metrics(_Remote({**cache.as_dict(), "disk": disk.as_dict()}))
    assert sample(text, "rayguide_grammar_cache_compiles", cache.compiles)
    assert sample(text, "rayguide_grammar_cache_store_disk_writes", disk.disk_writes)
    assert "rayguide_up 1.0" in text and handle is not None


@pytest.mark.parametrize("answer, delay_s", [({"compiles": 1}, 5.0),
                                             (RuntimeError("actor died"), 0.0)])
def test_a_slow_or_dead_cache_leaves_its_series_out_and_is_looked_up_again(answer, delay_s):
    text, handle = served_metrics(_Remote(answer, delay_s))
    assert "rayguide_grammar_cache_" not in text
    assert "rayguide_up 1.0" in text and "rayguide_replica_failovers" in text
    assert handle is None  # the next scrape finds the actor by name (it may be rebuilt)


def test_counters_are_typed_fields():
    stats = ClientStats()
    with pytest.raises(AttributeError):
        stats.fetchs += 1  # a typo fails; a string key would have been a silent zero


# the shared helpers -----------------------------------------------------------------------

@pytest.mark.parametrize("p", [1, 25, 50, 90, 99])
def test_percentile_matches_statistics_inclusive(p):
    xs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    expected = statistics.quantiles(xs, n=100, method="inclusive")[p - 1]
    assert percentile(xs, p) == pytest.approx(expected)


def test_percentile_edges():
    assert percentile([], 50) is None and percentile([], 50, 0.0) == 0.0
    assert math.isnan(percentile([], 99, math.nan))
    assert percentile([2.0], 99) == 2.0
    assert percentile([1.0, 2.0, 10.0], 100) == 10.0 and percentile([1.0, 2.0], 0) == 1.0
    assert percentile(iter([4.0, 2.0]), 50) == 3.0  # any iterable (a deque), unsorted


def test_backoff_doubles_to_its_cap_and_starts_over_when_made_again():
    assert list(itertools.islice(backoff(0.05, 1.0), 7)) == [0.05, 0.1, 0.2, 0.4, 0.8,
                                                               1.0, 1.0]
    assert list(itertools.islice(backoff(0.1), 3)) == [0.1, 0.2, 0.4]
    assert list(itertools.islice(backoff(1.0, 5.0, factor=3.0), 3)) == [1.0, 3.0, 5.0]


def test_the_load_tools_percentile_is_the_trees_rounded():
    from deploy.loadtest import _pct
    assert _pct([], 50) is None and _pct([0.123456], 99) == 0.1235
    xs = [0.3, 0.1, 0.2, 0.9]
    assert _pct(xs, 50) == round(percentile(xs, 50), 4) and _pct(xs, 100) == 0.9


def test_an_answer_of_no_tokens_is_counted_without_error():
    # Ray's Counter.inc(0) raises; a request that ended with no tokens (an abort, a session
    # flood's cut) was answered 500 from this line
    from deploy.metrics import Metrics
    metrics = Metrics()
    metrics.tokens(0)
    metrics.tokens(3)
    assert metrics.local.generated_tokens == 3
