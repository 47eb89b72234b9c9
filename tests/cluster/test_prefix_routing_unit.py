"""Prefix-aware routing (scheduler/routing.py, issue 59 item 2) without Ray: the longest
prefix wins within the margin, a busy holder spills and the spill makes a second holder,
sessions come first, a dropped or restarted worker holds nothing, and a run of 128
requests over 4 prefixes hits and stays balanced."""

import random
from collections import Counter

import pytest

from core.prefix_keys import CHUNK_CHARS, prefix_keys
from scheduler import routing
from scheduler.routing import RoutingTable

pytestmark = pytest.mark.unit


def table(n=3, **kw):
    t = RoutingTable(**kw)
    for i in range(n):
        t.add_worker(f"w{i}", handle=f"h{i}")
    return t


def test_the_longest_prefix_wins_and_ties_go_to_the_less_loaded():
    t = table(3)
    t.workers["w0"].remember_prefix(["k1"])
    t.workers["w1"].remember_prefix(["k1", "k2", "k3"])
    assert t.route(None, 10, prefix_keys=["k1", "k2", "k3", "k4"]).worker_id == "w1"
    assert t.prefix_routes == 1
    # w0 and w1 both hold one chunk of this prompt; w1 has 10 tokens routed to it now
    assert t.route(None, 10, prefix_keys=["k1", "other"]).worker_id == "w0"
    # a prompt nobody holds: by load, not counted
    assert t.route(None, 10, prefix_keys=["fresh"]).worker_id == "w2"
    assert t.prefix_routes == 2
    # ... and its worker holds it from now on, before any load report
    assert t.route(None, 10, prefix_keys=["fresh", "more"]).worker_id == "w2"


def test_prefix_beats_grammar_affinity_and_grammar_comes_next():
    t = table(3)
    t.update_load("w1", {"grammar_families": ["g"]})
    t.workers["w2"].remember_prefix(["p"])
    assert t.route(None, 10, "g", prefix_keys=["p"]).worker_id == "w2"
    assert t.route(None, 10, "g", prefix_keys=["q"]).worker_id == "w1"  # no holder: grammar
    assert (t.prefix_routes, t.affinity_routes) == (1, 1)


def test_a_busy_holder_spills_and_the_spill_makes_a_second_holder():
    t = table(2, prefix_margin_tokens=1000)
    keys = ["p1", "p2"]
    t.update_load("w0", {"running_tokens": 1500})
    t.update_load("w1", {"running_tokens": 0})
    t.workers["w0"].remember_prefix(keys)
    assert t.route(None, 100, prefix_keys=keys).worker_id == "w1"  # w0 is past the margin
    assert t.prefix_routes == 0
    assert t.workers["w1"].prefix_match(keys) == 2  # the spill holds it now
    t.update_load("w0", {"running_tokens": 900})
    t.update_load("w1", {"running_tokens": 500})
    # both hold it: the less loaded of them takes it
    assert t.route(None, 100, prefix_keys=keys).worker_id == "w1"
    assert t.prefix_routes == 1


def test_a_holder_over_the_queue_limit_is_passed_over():
    t = table(2, max_queued_tokens=2000, prefix_margin_tokens=1000)
    t.update_load("w0", {"running_tokens": 1900})
    t.update_load("w1", {"running_tokens": 1500})
    t.workers["w0"].remember_prefix(["p"])
    assert t.route(None, 256, prefix_keys=["p"]).worker_id == "w1"  # w0: within the margin,
    assert t.prefix_routes == 0  # but 1900 + 256 is over its limit


def test_a_negative_margin_turns_prefix_routing_off():
    t = table(2, prefix_margin_tokens=-1)
    t.route(None, 10, prefix_keys=["p"])
    assert Counter(t.route(None, 10, prefix_keys=["p"]).worker_id for _ in range(4)) == \
        {"w0": 2, "w1": 2}
    assert t.prefix_routes == 0


def test_a_session_stays_on_its_worker_whatever_the_prefix():
    t = table(2)
    t.workers["w1"].remember_prefix(["p"])
    assert t.route("s", 10).worker_id == "w0"
    assert t.route("s", 10, prefix_keys=["p"]).worker_id == "w0"
    assert t.prefix_routes == 0
    assert t.workers["w0"].prefix_match(["p"]) == 1  # the session's turn left it there too


def test_a_new_session_is_routed_by_its_prefix():
    t = table(2)
    t.workers["w1"].remember_prefix(["p"])
    assert t.route("s", 10, prefix_keys=["p"]).worker_id == "w1"
    assert t.sessions["s"][0] == "w1"


def test_a_dropped_or_restarted_worker_holds_no_prefix():
    t = table(2)
    t.update_load("w1", {"running_tokens": 100})
    t.workers["w1"].remember_prefix(["p"])
    t.drop_worker("w1")
    t.add_worker("w1", handle="h1")
    assert t.workers["w1"].prefix_match(["p"]) == 0
    t.workers["w1"].remember_prefix(["p"])
    t.add_worker("w1", handle="h1 restarted")  # registers again: its cache is gone
    assert t.route(None, 10, prefix_keys=["p"]).worker_id == "w0"
    assert t.prefix_routes == 0
    t.update_load("w0", {})  # a load report forgets nothing
    assert t.workers["w0"].prefix_match(["p"]) == 1


def test_a_worker_remembers_a_bounded_count_the_shortest_prefixes_last(monkeypatch):
    monkeypatch.setattr(routing, "PREFIX_KEYS_PER_WORKER", 4)
    t = table(1)
    entry = t.workers["w0"]
    entry.remember_prefix(["a1", "a2", "a3"])
    entry.remember_prefix(["b1", "b2"])
    assert len(entry.prefixes) == 4
    assert entry.prefix_match(["a1", "a2", "a3"]) == 2  # its longest went first
    entry.remember_prefix(["a1"])  # used again: the newest
    entry.remember_prefix(["c1", "c2"])
    assert entry.prefix_match(["a1", "a2"]) == 1 and entry.prefix_match(["c1", "c2"]) == 2


# the bar: 4 prefixes over 2-4 workers, 128 requests ---------------------------------

SHARED_CHUNKS = 4000 // CHUNK_CHARS  # a 1,024-token instruction is about 4,000 characters


def instruction(i: int) -> str:
    return f"Instruction set {i}: extract the fields of the document below as JSON. " * 60


def run(workers: int, weights: list[float], seed: int, keyed: bool = True):
    """Routes 128 requests (one of 4 instructions by ``weights``, then a row of their own)
    with no load report in between; returns the hit rate (the chosen worker was already
    sent the request's whole instruction) and each worker's routed tokens."""
    rng = random.Random(seed)
    t = table(workers)
    hits = 0
    for n in range(128):
        which = rng.choices(range(4), weights)[0]
        prompt = instruction(which)[:4000] + f"Row {n}: invoice {rng.random()} " * 4
        keys = prefix_keys(prompt, "tenant")
        held = {w: e.prefix_match(keys) for w, e in t.workers.items()}
        chosen = t.route(None, rng.randint(32, 512), prefix_keys=keys if keyed else None)
        if not keyed:
            chosen.remember_prefix(keys)  # what its cache holds all the same
        hits += held[chosen.worker_id] >= SHARED_CHUNKS
    return hits / 128, {w: e.routed_since_report for w, e in t.workers.items()}, t


@pytest.mark.parametrize("workers", [2, 3, 4])
@pytest.mark.parametrize("weights", [[1, 1, 1, 1], [7, 1, 1, 1]], ids=["even", "popular"])
@pytest.mark.parametrize("seed", range(3))
def test_four_prefixes_hit_and_stay_balanced(workers, weights, seed):
    rate, load, t = run(workers, weights, seed)
    mean = sum(load.values()) / workers
    assert rate >= 0.9, (rate, load)
    assert max(load.values()) <= 1.5 * mean, (rate, load)
    assert t.prefix_routes >= 0.9 * 128 - 4 * workers


def test_prefix_routing_keeps_a_prefix_on_fewer_workers_than_load_alone():
    """By load alone every worker soon computes every instruction (what an engine's cache
    would hold is remembered all the same); by prefix, fewer workers compute each one."""
    def holders(t):
        return sum(e.prefix_match(prefix_keys(instruction(i)[:4000], "tenant")) > 0
                   for i in range(4) for e in t.workers.values())

    routed_rate, _, routed = run(4, [1, 1, 1, 1], 0)
    load_rate, _, by_load = run(4, [1, 1, 1, 1], 0, keyed=False)
    assert holders(by_load) == 16 and holders(routed) <= 8
    assert routed_rate > load_rate


def test_the_scheduler_actor_routes_by_prefix_and_counts_it():
    """The actor passes the client's keys (positionally: the client's call) to its table,
    takes its margin from SchedulerConfig and shows prefix_routes in stats()."""
    import asyncio

    from scheduler.actor import SchedulerActor, SchedulerConfig

    class Worker:
        def __init__(self, worker_id):
            self.worker_id, self.load = worker_id, self

        async def remote(self):  # load.remote()
            return {"worker_id": self.worker_id, "running_tokens": 0, "waiting_tokens": 0}

    workers = {f"rayguide_worker_{i}": Worker(f"w{i}") for i in range(2)}
    s = SchedulerActor.__ray_actor_class__(SchedulerConfig(prefix_margin_tokens=4096))
    s._names, s._lookup = lambda: sorted(workers), workers.__getitem__

    async def main():
        first = await s.route(None, 10, None, [], ["p1", "p2"])
        again = await s.route(None, 10, None, [], ["p1", "p2", "p3"])
        queued = s.table.workers[first["worker_id"]].queued_tokens
        await s.route(None, 10, None, [], ["q1"], done=[
            (first["worker_id"], first["epoch"], 10), (again["worker_id"], again["epoch"], 10)])
        # the two ended before the third was routed (to the same worker: both are empty
        # now, and ties go by id)
        assert s.table.workers[first["worker_id"]].queued_tokens == queued - 20 + 10
        return first, again, await s.stats()
    first, again, stats = asyncio.run(main())
    assert again["worker_id"] == first["worker_id"]
    assert s.table.prefix_margin_tokens == 4096
    assert stats["prefix_routes"] == 1 and stats["routes"] == 3


class _Method:
    def __init__(self, fn):
        self.remote = fn


def test_the_client_sends_the_prompts_keys_in_its_cache_scope():
    """RuntimeClient.generate computes the keys once from the prompt and the request's
    cache_scope (read with getattr: absent, the shared scope) and sends them with each
    route; a grammar check sends none."""
    import asyncio

    from cluster.client import RuntimeClient
    from core.grammar_spec import GrammarSpec
    from core.params import SamplingParams
    from core.request import GenerationRequest, RequestOutput

    sent = []

    class Worker:
        def __init__(self):
            def generate(req):
                async def stream():
                    ref = asyncio.get_running_loop().create_future()
                    ref.set_result(RequestOutput(req.request_id, finished=True))
                    yield ref
                return stream()
            self.generate = _Method(generate)
            self.abort = _Method(lambda request_id: None)

            async def check(spec, client, wait_s):
                return {}
            self.check_grammar = _Method(check)

    class Scheduler:
        def __init__(self, worker):
            async def route(session_id, expected, family, avoid, keys=None):
                sent.append(keys)
                return {"worker_id": "w0", "handle": worker}

            async def watch(timeout_s):
                await asyncio.sleep(timeout_s)
            self.route, self.watch = _Method(route), _Method(watch)

    prompt = [{"role": "system", "content": instruction(0)}, {"role": "user", "content": "r"}]
    plain = GenerationRequest(prompt, SamplingParams(max_new_tokens=4))
    scoped = GenerationRequest(prompt, SamplingParams(max_new_tokens=4))
    scoped.cache_scope = "tacme"  # the engine's field; set here as the edge will

    async def main():
        client = RuntimeClient(scheduler=Scheduler(Worker()))
        await client.complete(plain)
        await client.complete(scoped)
        await client.check_grammar(GrammarSpec.regex("a+"))
    asyncio.run(main())
    assert sent == [prefix_keys(prompt), prefix_keys(prompt, "tacme"), None]
    assert len(sent[0]) == 16 and sent[0] != sent[1]


def test_a_worker_is_believed_to_hold_what_its_kv_cache_could():
    """A worker whose cache holds 64 blocks of 16 tokens (1,024 tokens, about 16 keys of 64
    tokens) is remembered holding its newest 16 keys: an older prefix ages out of the
    table about when the worker's LRU cache drops it, and routing stops counting on it."""
    t = table(2)
    w0 = t.workers["w0"]
    assert w0.prefix_capacity == routing.PREFIX_KEYS_PER_WORKER  # before a load report
    t.update_load("w0", {"total_blocks": 64, "block_size": 16})
    assert w0.prefix_capacity == 16
    w0.remember_prefix([f"old{i}" for i in range(8)])
    w0.remember_prefix([f"new{i}" for i in range(12)])
    assert len(w0.prefixes) == 16 and w0.prefix_match(["new0"]) == 1
    assert w0.prefix_match([f"old{i}" for i in range(8)]) == 4  # its 4 shortest are left


def test_a_request_that_ended_leaves_its_workers_load_before_the_next_report():
    """Between two load reports a worker's load counts what was routed there; a request
    reported ended with the epoch it was routed in leaves it (a burst of short requests no
    longer piles up on the prefix's holder until it spills). One routed before the last
    report is that report's to count: its end changes nothing."""
    t = table(2)
    t.update_load("w0", {"running_tokens": 0})
    w0 = t.workers["w0"]
    epoch = w0.reports
    for _ in range(3):
        assert t.route(None, 500, prefix_keys=["p1", "p2"]).worker_id == "w0"
    assert w0.queued_tokens == 1500
    t.finished([("w0", epoch, 500), ("w0", epoch, 500)])
    assert w0.queued_tokens == 500
    t.update_load("w0", {"running_tokens": 500})  # the third, counted by the report
    t.finished([("w0", epoch, 500)])  # an older epoch: the report stands
    assert w0.queued_tokens == 500
    t.finished([("gone", 0, 500), ("w0", w0.reports, 10_000)])  # never below zero
    assert w0.queued_tokens == 500 and w0.routed_since_report == 0


def test_the_client_reports_its_ended_requests_with_its_next_route():
    """RuntimeClient tells the scheduler of a request's end with its next route: the
    worker, the epoch its route answered with, and the tokens it was expected to cost."""
    import asyncio

    from cluster.client import RuntimeClient
    from core.params import SamplingParams
    from core.request import GenerationRequest, RequestOutput

    sent = []

    class Worker:
        def __init__(self):
            def generate(req):
                async def stream():
                    ref = asyncio.get_running_loop().create_future()
                    ref.set_result(RequestOutput(req.request_id, finished=True))
                    yield ref
                return stream()
            self.generate = _Method(generate)
            self.abort = _Method(lambda request_id: None)

    class Scheduler:
        def __init__(self, worker):
            async def route(session_id, expected, family, avoid, keys=None, done=None):
                sent.append((expected, done))
                return {"worker_id": "w0", "handle": worker, "epoch": 7}

            async def watch(timeout_s):
                await asyncio.sleep(timeout_s)
            self.route, self.watch = _Method(route), _Method(watch)

    async def main():
        client = RuntimeClient(scheduler=Scheduler(Worker()))
        for n in (4, 8):
            await client.complete(GenerationRequest("hello", SamplingParams(max_new_tokens=n)))
    asyncio.run(main())
    (first, none), (_, done) = sent
    assert none is None and done == [("w0", 7, first)]
