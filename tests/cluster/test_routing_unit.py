"""The scheduler's routing table without Ray, and the cluster config."""

import time

from collections import Counter

import pytest

from cluster.config import ClusterConfig
from core.errors import NoWorkers, Overloaded
from scheduler.routing import RoutingTable

pytestmark = pytest.mark.unit


def table(n=3, **kw):
    t = RoutingTable(**kw)
    for i in range(n):
        t.add_worker(f"w{i}", handle=f"h{i}", node_id=f"n{i}")
    return t


def test_sticky_sessions_and_spread_of_new_ones():
    t = table()
    first = {s: t.route(s).worker_id for s in ("a", "b", "c")}
    assert sorted(first.values()) == ["w0", "w1", "w2"]  # a burst spreads before any report
    assert all(t.route(s).worker_id == w for s, w in first.items())  # later turns stick


def test_least_loaded_by_reported_tokens():
    t = table()
    t.update_load("w0", {"running_tokens": 5000, "waiting_tokens": 0})
    t.update_load("w1", {"running_tokens": 100, "waiting_tokens": 900})
    t.update_load("w2", {"running_tokens": 10, "waiting_tokens": 10})
    assert t.route("new").worker_id == "w2"
    assert t.route(None).worker_id == "w2"  # one-shot requests are not pinned
    assert "new" in t.sessions and len(t.sessions) == 1


def test_overloaded_and_no_workers():
    t = table(2, max_queued_tokens=1000)
    for w in ("w0", "w1"):
        t.update_load(w, {"running_tokens": 900, "waiting_tokens": 0})
    with pytest.raises(Overloaded, match="retry later"):
        t.route("s", expected_tokens=200)
    with pytest.raises(NoWorkers, match="no worker is alive"):
        RoutingTable().route("s")


def test_dead_worker_orphans_its_sessions():
    t = table(2)
    w = t.route("s").worker_id
    assert t.drop_worker(w) == ["s"]
    assert t.route("s").worker_id != w  # re-routed (its KV is recomputed there)


def test_slow_worker_is_routed_around_not_dropped():
    t = table(2)
    w = t.route("s").worker_id
    other = next(x for x in t.workers if x != w)
    t.suspect(w)
    assert w in t.workers  # kept: slow is not dead
    assert t.route("new").worker_id == other
    assert t.route("s").worker_id == other  # its session moves while it does not answer
    t.suspect(other)
    assert t.route(None).worker_id in t.workers  # every worker slow: still no 503
    t.update_load(w, {"running_tokens": 0})  # answered again
    assert not t.workers[w].suspect
    assert t.route("later").worker_id == w


def test_a_request_is_not_routed_back_to_a_worker_it_died_on():
    t = table(2)
    t.update_load("w0", {"running_tokens": 0, "waiting_tokens": 0})  # the idle one ...
    t.update_load("w1", {"running_tokens": 4000, "waiting_tokens": 0})
    t.route("s")  # pinned to w0
    assert t.route("s", avoid=frozenset({"w0"})).worker_id == "w1"  # ... died on: elsewhere
    t.suspect("w0")
    t.suspect("w1")  # every worker suspect (one restarting, one busy): still not back
    assert t.route(None, avoid=frozenset({"w0"})).worker_id == "w1"
    assert t.route(None, avoid=frozenset({"w0", "w1"})).worker_id in ("w0", "w1")  # no 503
    one = table(1)
    assert one.route(None, avoid=frozenset({"w0"})).worker_id == "w0"  # the only one left


def test_idle_sessions_and_restore():
    t = table(1, session_idle_timeout_s=0.05)
    t.route("old")
    time.sleep(0.1)
    t.route("fresh")
    assert t.idle_sessions() == ["old"]
    t2 = table(2)
    t2.restore_sessions("w1", ["x", "y"])
    assert t2.route("x").worker_id == "w1"


def test_cluster_config_checks_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_workers: 3\nworker: {num_cpus: 0.5}\nengine: {max_num_seqs: 8}\n")
    config = ClusterConfig.from_yaml(path, model="/m")
    assert config.num_workers == 3 and config.worker.num_cpus == 0.5
    assert config.engine.max_num_seqs == 8 and config.engine.model == "/m"
    path.write_text("num_wrokers: 3\n")
    with pytest.raises(ValueError, match="num_wrokers"):
        ClusterConfig.from_yaml(path)
    with pytest.raises(ValueError, match="max_num_sequences"):
        ClusterConfig(engine={"max_num_sequences": 8})
    with pytest.raises(ValueError, match="num_workers"):
        ClusterConfig(num_workers=0)


def test_grammar_affinity_within_the_margin():
    t = table(3, affinity_margin_tokens=1000)
    for w, tokens in (("w0", 0), ("w1", 500), ("w2", 3000)):
        t.update_load(w, {"running_tokens": tokens, "grammar_families": ["g"] if w != "w0"
                          else []})
    # w1 holds the grammar and is within the margin of the least loaded (w0): it wins
    assert t.route(None, 10, grammar_family="g").worker_id == "w1"
    assert t.affinity_routes == 1
    # w2 holds it too but is too busy; an unknown grammar goes to the least loaded
    t.update_load("w1", {"running_tokens": 2000, "grammar_families": ["g"]})
    assert t.route(None, 10, grammar_family="g").worker_id == "w0"
    # ... which from then on counts as holding it (before its next load report)
    assert t.route(None, 10, grammar_family="g").worker_id == "w0"
    assert t.route(None, 10, grammar_family="other").worker_id == "w0"


def test_a_cheap_grammar_is_routed_by_load_alone():
    """A grammar llguidance serves (a worker reports it cheap: compiled in a millisecond)
    gets no affinity: a burst of its requests spreads over the workers by load instead of
    piling into the batch of the first worker that saw it."""
    t = table(2, affinity_margin_tokens=2048)
    t.update_load("w0", {"grammar_families": [], "cheap_grammar_families": ["g"]})
    t.update_load("w1", {})
    routed = Counter(t.route(None, 24, grammar_family="g").worker_id for _ in range(16))
    assert routed == {"w0": 8, "w1": 8}
    assert t.affinity_routes == 0
    # the same burst of a grammar nobody reports cheap: the first worker to get it keeps it
    t2 = table(2, affinity_margin_tokens=2048)
    t2.update_load("w0", {})
    t2.update_load("w1", {})
    routed = Counter(t2.route(None, 24, grammar_family="g").worker_id for _ in range(16))
    assert routed == {"w0": 16}


def test_sessions_stick_before_grammar_affinity():
    t = table(2)
    t.update_load("w1", {"grammar_families": ["g"]})
    t.update_load("w0", {})
    first = t.route("s", 10).worker_id
    assert t.route("s", 10, grammar_family="g").worker_id == first


def test_an_idle_worker_takes_any_budget():
    t = table(1, max_queued_tokens=1000)
    assert t.route(None, 10**9).worker_id == "w0"  # not a 429 on an idle cluster
    with pytest.raises(Overloaded):
        t.route(None, 10**9)  # now it has work queued



# grammar checks have a cost (issue 58, item 1) ---------------------------------------------

def test_a_grammar_check_counts_as_queued_tokens():
    """Checks routed since the last report, and those a worker reports queued, count
    CHECK_COST_TOKENS each: a flood of checks spreads over the workers and is refused
    (Overloaded) past the queue limit, as requests are."""
    from scheduler.routing import CHECK_COST_TOKENS

    t = table(2, max_queued_tokens=4 * CHECK_COST_TOKENS)
    routed = Counter(t.route(None, CHECK_COST_TOKENS, f"family{i}").worker_id
                     for i in range(8))
    assert routed == {"w0": 4, "w1": 4}
    with pytest.raises(Overloaded):
        t.route(None, CHECK_COST_TOKENS, "another")
    # one grammar checked again and again: affinity keeps it where it is held while
    # that worker has room, never past its limit while another worker has room
    t = table(2, max_queued_tokens=4 * CHECK_COST_TOKENS,
              affinity_margin_tokens=8 * CHECK_COST_TOKENS)
    routed = Counter(t.route(None, CHECK_COST_TOKENS, "family").worker_id for _ in range(8))
    assert routed == {"w0": 4, "w1": 4}
    # a worker whose report says it has checks queued is as loaded as their cost
    t.update_load("w0", {"running_tokens": 0, "waiting_tokens": 0, "checks_queued": 3})
    t.update_load("w1", {"running_tokens": 0, "waiting_tokens": 0, "checks_queued": 0})
    assert t.workers["w0"].queued_tokens == 3 * CHECK_COST_TOKENS
    assert t.route(None).worker_id == "w1"


def test_the_client_routes_a_check_at_its_cost():
    import asyncio

    from cluster.client import RuntimeClient
    from core.grammar_spec import GrammarSpec
    from scheduler.routing import CHECK_COST_TOKENS

    seen = []

    class Worker:
        class check_grammar:  # noqa: N801 - a Ray method's shape
            @staticmethod
            async def remote(spec, client, wait_s):
                return {"id": "g"}

    async def route(session, expected, family, died_on):
        seen.append(expected)
        return {"worker_id": "w0", "handle": Worker}

    client = RuntimeClient(scheduler=object())
    client._route_after_deaths = route
    asyncio.run(client.check_grammar(GrammarSpec.regex("a+"), "c", 0.0))
    assert seen == [CHECK_COST_TOKENS]
