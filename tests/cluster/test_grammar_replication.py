"""Issue 14: the disk tier, the hot list, warm replication through real workers.

A new worker added to a warm cluster serves the cluster's known grammars without fetching
or compiling them on the request path; a restarted cache (or cluster) warms from the disk
instead of compiling; configured hot grammars are on every worker before any request.
Real Ray (a local instance), real xgrammar, real child-process compiles, the tiny model."""

import asyncio
import json
import os
import time
import uuid

import pytest
import ray
import xgrammar as xgr

from grammar_cache import envelope
from grammar_cache.actor import GrammarCache, GrammarCacheConfig
from grammar_cache.compile import tokenizer_fingerprint
from grammar_cache.disk import DiskStore
from core.grammar_spec import GrammarSpec

pytestmark = pytest.mark.integration

VOCAB = ["<eos>", "{", "}", '"', "a", "b", ":", ",", " ", "1", "2", "[", "]", "x", "y", "0"] + \
    [chr(c) for c in range(ord("c"), ord("w"))]


def spec(i=0):
    return GrammarSpec.json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"}},
                                    "required": [f"p{i}"]})


def tiny_cache(tmp_path, **config):
    # local_verdict_factor inf: always the serialized grammar (tiny grammars load slower
    # than they compile, and would be sent as verdicts)
    config.setdefault("local_verdict_factor", float("inf"))
    config.setdefault("compile_processes", 1)
    cache = GrammarCache(GrammarCacheConfig(disk=True, disk_dir=str(tmp_path), **config))
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[0])
    fp = tokenizer_fingerprint(info)
    cache.register_tokenizer(fp, info.serialize_json())
    return cache, info, fp


# the disk tier --------------------------------------------------------------------------

def test_disk_store_atomic_bounded_and_versioned(tmp_path):
    store = DiskStore(tmp_path, max_bytes=2500)
    for i in range(3):
        assert store.put("fp", f"k{i}", bytes([i]) * 1000)
        time.sleep(0.01)  # distinct mtimes: eviction order is by last use
    # 3000 bytes over a 2500 bound: the least recently used one went
    assert store.get("fp", "k0") is None
    assert store.get("fp", "k2") == bytes([2]) * 1000
    assert not list(tmp_path.rglob("*.tmp"))  # written through a renamed temporary file
    # the path names the xgrammar and serialization versions: another version's folder is
    # another cache
    assert store.path("fp", "k1").parent.parent.name.startswith(
        f"xgr-{envelope.XGRAMMAR_VERSION}-s")
    assert store.put("fp", "huge", b"x" * 3000) is False  # over the whole bound: not kept


def test_restarted_cache_warms_from_disk(tmp_path):
    first, info, fp = tiny_cache(tmp_path)
    try:
        data = asyncio.run(first.get(spec(1), fp))
        assert first.counts.compiles == 1
    finally:
        first.close()
    second, _, _ = tiny_cache(tmp_path)  # the actor restarted (or the whole cluster)
    try:
        again = asyncio.run(second.get(spec(1), fp))
        assert second.counts.compiles == 0 and second.counts.disk_hits == 1
        m = xgr.GrammarMatcher(envelope.unpack(again, info, fp))
        assert m.accept_string('{"p1": 2}') and data == again
        # a grammar it never compiled is still compiled (and an invalid one is not kept)
        asyncio.run(second.get(spec(2), fp))
        assert second.counts.compiles == 1
        asyncio.run(second.get(GrammarSpec.regex("[z-a]"), fp))
        assert not second.disk.has(fp, GrammarSpec.regex("[z-a]").key(fp))
    finally:
        second.close()


def test_a_file_for_another_tokenizer_is_never_loaded(tmp_path):
    cache, info, fp = tiny_cache(tmp_path)
    try:
        other = DiskStore(tmp_path)
        key = spec(3).key(fp)
        # a stale envelope under this key: right name, wrong tokenizer inside
        other.put(fp, key, envelope.pack_local("another-fingerprint", key, 0.1))
        data = asyncio.run(cache.get(spec(3), fp))
        assert cache.counts.disk_hits == 0 and cache.counts.compiles == 1
        assert "grammar" in envelope.read_header(data)
    finally:
        cache.close()


def test_an_answer_leaves_when_its_compile_is_done_not_behind_queued_compiles(tmp_path):
    """Ten grammars asked at once of one compile process: each answer goes out as soon as
    its own compile is done (the disk write runs in the background), not after compiles
    queued behind it. With the event loop's default threads, queued compiles held the
    threads the disk write needed, and the first answers waited for later compiles."""
    cache, info, fp = tiny_cache(tmp_path, compile_processes=1)
    seen = []

    async def ask(i):
        data = await cache.get(spec(10 + i), fp)
        seen.append(cache.counts.compiles)  # compiles done when this answer left
        return data

    async def main():
        return await asyncio.gather(*(ask(i) for i in range(10)))

    try:
        answers = asyncio.run(main())
        assert all("grammar" in envelope.read_header(a) for a in answers)
        assert seen == list(range(1, 11))
    finally:
        cache.close()
    # and every one reached the disk (close waits for the background writes)
    store = DiskStore(tmp_path)
    assert all(store.has(fp, spec(10 + i).key(fp)) for i in range(10))


# the hot list ---------------------------------------------------------------------------

def test_hot_after_two_requests_or_by_config(tmp_path):
    configured = {"kind": "json_schema", "source": {"type": "object"}}
    cache, info, fp = tiny_cache(tmp_path, hot_specs=[configured])
    try:
        answer = cache.hot(fp, 0, [])
        assert [s.kind for s in answer["specs"]] == ["json_schema"] and answer["cursor"] == 1
        assert answer["known"] and not cache.hot("another tokenizer", 0, [])["known"]
        s1 = spec(4)
        answer = cache.hot(fp, 1, [(s1.key(fp), 1, s1)])
        assert answer["specs"] == []  # asked once: not hot yet
        answer = cache.hot(fp, 1, [(s1.key(fp), 1, None)])  # spec sent before
        assert answer["specs"] == [s1] and answer["cursor"] == 2
        assert cache.hot(fp, 2, [])["specs"] == []  # each worker gets each one once
        # a new worker (cursor 0) gets the whole list, most requested first
        assert cache.hot(fp, 0, [])["specs"] == [s1, GrammarSpec.json_schema({"type": "object"})]
        bad = GrammarSpec.regex("[z-a]")
        asyncio.run(cache.get(bad, fp))  # invalid: a cached error
        cache.hot(fp, 2, [(bad.key(fp), 5, bad)])
        assert bad not in cache.hot(fp, 0, [])["specs"]  # known to fail: never replicated
    finally:
        cache.close()


def test_hot_reports_compiles_running_or_queued(tmp_path):
    cache, info, fp = tiny_cache(tmp_path)

    async def scenario():
        assert cache.hot(fp, 0, [])["compiling"] == 0
        tasks = [asyncio.create_task(cache.get(spec(60 + i), fp)) for i in range(2)]
        deadline = time.monotonic() + 60  # a hang guard, not a speed bound
        while cache.compiling < 2:  # one compiling, one waiting for the one process
            assert time.monotonic() < deadline, f"compiling: {cache.compiling}"
            await asyncio.sleep(0.01)
        assert cache.hot(fp, 0, [])["compiling"] == 2
        await asyncio.gather(*tasks)
        assert cache.hot(fp, 0, [])["compiling"] == 0

    try:
        asyncio.run(scenario())
    finally:
        cache.close()


class _FakeCacheActor:
    """``hot.remote`` as the Replicator calls it: an awaitable answer."""

    def __init__(self, specs):
        self.specs, self.compiling, self.known = specs, 0, True
        self.hot = self

    def remote(self, fp, since, report):
        async def answer():
            return {"cursor": len(self.specs), "specs": self.specs[since:],
                    "compiling": self.compiling, "known": self.known}
        return answer()


def test_prefetching_waits_for_the_actors_compiles_but_not_forever(monkeypatch):
    from concurrent.futures import Future

    from grammar_cache import replication

    actor = _FakeCacheActor([spec(70), spec(71)])
    fetched = []

    def prefetch(s):
        fetched.append(s)
        fut = Future()
        fut.set_result(None)
        return fut

    rep = replication.Replicator(GrammarCacheConfig(), "fp", actor=lambda: actor,
                                 prefetch=prefetch, holds=lambda s: s in fetched,
                                 held_bytes=lambda: 0)
    actor.compiling = 3  # requests somewhere wait for compiles: speculative work waits
    assert asyncio.run(rep.poll_once()) == 0 and fetched == []
    assert asyncio.run(rep.poll_once()) == 0 and fetched == []  # still kept, not dropped
    assert rep.stats()["prefetch_deferred_compiling"] == 2
    clock = [time.monotonic() + replication.MAX_DEFER_S + 1]  # compiling for too long
    monkeypatch.setattr(replication.time, "monotonic", lambda: clock[0])
    assert asyncio.run(rep.poll_once()) == 2 and fetched == [spec(70), spec(71)]
    actor.specs.append(spec(72))
    actor.compiling = 0  # drained: fetched at once
    assert asyncio.run(rep.poll_once()) == 1


def test_a_worker_registers_its_tokenizer_when_the_actor_lacks_it():
    from concurrent.futures import Future

    from grammar_cache import replication

    actor = _FakeCacheActor([spec(80)])
    actor.known = False
    registered = []

    def register():
        registered.append(1)
        actor.known = True

    def prefetch(s):
        fut = Future()
        fut.set_result(None)
        return fut

    rep = replication.Replicator(GrammarCacheConfig(), "fp", actor=lambda: actor,
                                 prefetch=prefetch, holds=lambda s: False,
                                 held_bytes=lambda: 0, register=register)
    assert asyncio.run(rep.poll_once()) == 1  # registered, asked again, prefetched
    assert registered == [1] and rep.stats()["replication_registrations"] == 1
    assert asyncio.run(rep.poll_once()) == 0 and registered == [1]


def test_replication_off_keeps_the_list_empty(tmp_path):
    cache, info, fp = tiny_cache(tmp_path, replicate=False)
    try:
        s1 = spec(5)
        answer = cache.hot(fp, 0, [(s1.key(fp), 9, s1)])
        assert answer["cursor"] == 0 and answer["specs"] == []
    finally:
        cache.close()


# through the runtime --------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}}, "required": ["city", "n"]}
HOT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory, shared_ray):
    from cluster import launch
    from cluster.config import ClusterConfig

    disk = tmp_path_factory.mktemp("grammar-disk")
    config = ClusterConfig(
        model=str(tiny_model_dir), num_workers=2,
        worker={"num_cpus": 0.25, "num_threads": 1},
        engine={"num_kv_blocks": 128, "grammar_engine": "xgrammar"},  # the cache is xgrammar's
        grammar_cache={"disk": True, "disk_dir": str(disk), "replicate_interval_s": 0.2,
                       "hot_specs": [{"kind": "json_schema", "source": HOT}]},
        scheduler={"load_poll_interval_s": 0.2})
    with shared_ray():
        handles = launch.up(config)
        yield config, handles


def guided(schema, max_tokens=24):
    from core.params import SamplingParams
    from core.request import GenerationRequest
    return GenerationRequest([{"role": "user", "content": "JSON please"}],
                             SamplingParams(max_new_tokens=max_tokens, temperature=0.0),
                             grammar=GrammarSpec.json_schema(schema))


def wait_for(predicate, what, timeout_s=120.0):
    """Polls until ``predicate()``; a bounded wait, not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(0.2)


def grammar_stats(worker):
    return ray.get(worker.load.remote())["grammar_client"]


def test_new_worker_serves_known_grammars_without_fetching(cluster):
    from cluster.client import RuntimeClient
    from scheduler.actor import NAMESPACE, SCHEDULER_NAME, WORKER_PREFIX
    from grammar_cache.actor import ACTOR_NAME
    from worker.actor import WorkerActor

    config, handles = cluster
    client = RuntimeClient()
    # a grammar asked for twice: hot
    for _ in range(2):
        out = asyncio.run(client.complete(guided(SCHEMA)))
        assert out.finish_reason in ("stop", "length") and out.error is None, out
    cache = handles["cache"]
    wait_for(lambda: ray.get(cache.stats.remote())["hot"] >= 2, "the grammar turning hot")
    compiles = ray.get(cache.stats.remote())["compiles"]

    # a new worker joins the warm cluster
    new = WorkerActor.options(name=f"{WORKER_PREFIX}new-{uuid.uuid4().hex[:4]}",
                              namespace=NAMESPACE, num_cpus=0.25).remote(
        config.engine, "w-new", (SCHEDULER_NAME, NAMESPACE),
        (ACTOR_NAME, NAMESPACE, config.grammar_cache))
    # both hot grammars (the configured one and the requested one), in the background
    wait_for(lambda: grammar_stats(new).get("prefetches", 0) >= 2, "the new worker's prefetch")
    before = grammar_stats(new)
    assert before["grammar_requests"] == 0  # nothing asked it for anything yet
    families = ray.get(new.load.remote())["grammar_families"]
    assert GrammarSpec.json_schema(SCHEMA).family in families  # affinity routing sees it

    for schema in (SCHEMA, HOT):
        chunks = [ray.get(r) for r in new.generate.remote(guided(schema, 16))]
        assert chunks[-1].finished and chunks[-1].error is None, chunks[-1]
    after = grammar_stats(new)
    assert after["grammar_requests"] == 2
    assert after["grammar_request_waits"] == 0  # ready on arrival: no wait on the path
    assert after["fetches"] == before["fetches"]  # nothing fetched or compiled for them
    assert ray.get(cache.stats.remote())["compiles"] == compiles
    ray.kill(new, no_restart=True)


def test_configured_hot_grammar_on_every_worker_before_any_request(cluster):
    _, handles = cluster
    for w in handles["workers"]:
        wait_for(lambda: GrammarSpec.json_schema(HOT).family in
                 ray.get(w.load.remote())["grammar_families"], "the configured hot grammar")
    stats = ray.get(handles["cache"].stats.remote())
    assert stats["compiles_per_distinct_grammar"] == pytest.approx(1.0)
    assert stats["disk"]["disk_writes"] >= 1  # what it compiled is on this node's disk


def test_metrics_show_replication_and_waits(cluster):
    from deploy.metrics import Metrics

    _, handles = cluster
    loads = {f"w{i}": ray.get(w.load.remote()) for i, w in enumerate(handles["workers"])}
    text = Metrics().render({"sessions": 0, "workers": loads})
    for name in ("prefetches", "grammar_request_waits", "disk_hits", "local_fallbacks"):
        assert f"rayguide_worker_grammar_client_{name}{{" in text, name
    assert "rayguide_worker_grammar_local_hits{" in text
