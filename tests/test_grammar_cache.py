"""The shared grammar cache: one compile per key cluster-wide, hard time limit, fallback when
the actor is down and reuse when it is back, envelope checks, byte-bounded LRU.
Real Ray (a local instance), real child-process compiles."""

import asyncio
import time
import uuid

import msgpack
import pytest
import ray
import xgrammar as xgr

from grammar_cache import envelope
from grammar_cache.actor import GrammarCache, GrammarCacheConfig, get_or_create_actor
from grammar_cache.client import GrammarCacheClient
from grammar_cache.compile import GrammarError, tokenizer_fingerprint
from grammar_cache.compile_pool import CompileLimits
from grammar_cache.spec import GrammarSpec

pytestmark = pytest.mark.integration

VOCAB = ["<eos>", "{", "}", '"', "a", "b", ":", ",", " ", "1", "2", "true", "false", "[", "]",
         "x", "y", "z", "0", "-"] + [chr(c) for c in range(ord("c"), ord("w"))]
# about 7 s to compile with the default model's tokenizer (distinct long string bounds)
SLOW = GrammarSpec.json_schema({"type": "object", "required": [f"p{i}" for i in range(10)],
                                "properties": {f"p{i}": {"type": "string",
                                                         "minLength": 1000 + 37 * i,
                                                         "maxLength": 3000 + 53 * i}
                                               for i in range(10)}})


def tiny_info():
    return xgr.TokenizerInfo(VOCAB, stop_token_ids=[0])


def spec(i=0):
    return GrammarSpec.json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"}},
                                    "required": [f"p{i}"]})


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def actor_name(ray_local):
    return f"gc-{uuid.uuid4().hex[:8]}"


def new_actor(name, **config):
    actor = get_or_create_actor(GrammarCacheConfig(**config), name=name)
    ray.get(actor.ping.remote())
    return actor


@ray.remote(num_cpus=0.5)
def fetch_in_task(name, spec_dict):
    client = GrammarCacheClient(tiny_info(), name=name)
    compiled = client.fetch(GrammarSpec.from_dict(spec_dict))
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string('{"p0": 7}') and m.accept_token(0), client.counts


def test_four_processes_one_compile(actor_name):
    actor = new_actor(actor_name)
    slowish = GrammarSpec.json_schema({"type": "object", "properties": {
        "p0": {"type": "integer"}, "pad": {"type": "string", "maxLength": 3000}},
        "required": ["p0"]})
    results = ray.get([fetch_in_task.remote(actor_name, slowish.to_dict()) for _ in range(4)])
    assert all(ok for ok, _ in results)
    assert all(counts["actor"] + counts["verdict"] == 1 and counts["local"] == 0
               for _, counts in results)
    stats = ray.get(actor.stats.remote())
    assert stats["compiles"] == 1
    assert stats["misses"] == 1 and stats["hits"] + stats["joined"] == 3


def test_concurrent_asks_share_one_compile():
    cache = GrammarCache(GrammarCacheConfig(compile_processes=2))
    info = tiny_info()
    fp = tokenizer_fingerprint(info)
    cache.register_tokenizer(fp, info.serialize_json())

    async def main():
        return await asyncio.gather(*(cache.get(spec(1).to_dict(), fp) for _ in range(4)))

    try:
        datas = asyncio.run(main())
        assert len(set(datas)) == 1
        assert cache.counts["compiles"] == 1 and cache.counts["joined"] == 3
    finally:
        cache.close()


def test_slow_compile_stopped_at_limit_while_others_finish(actor_name, default_tokenizer):
    actor = new_actor(actor_name, compile_timeout_s=1.0, compile_processes=2)
    info = xgr.TokenizerInfo.from_huggingface(default_tokenizer, vocab_size=49152,
                                              stop_token_ids=[2])
    client = GrammarCacheClient(info, name=actor_name)
    client.fetch(spec(0))  # registers the tokenizer, warms a compile process
    fp = client.fingerprint
    t = time.monotonic()
    slow_ref = actor.get.remote(SLOW.to_dict(), fp)
    fast_refs = [actor.get.remote(spec(i).to_dict(), fp) for i in range(1, 4)]
    fast = ray.get(fast_refs)
    fast_done = time.monotonic() - t
    slow = ray.get(slow_ref)
    slow_done = time.monotonic() - t
    assert all("error" not in envelope.read_header(d) for d in fast)
    header = envelope.read_header(slow)
    assert header["error_kind"] == "timeout" and "longer than 1 s" in header["error"]
    assert fast_done < slow_done and slow_done < 15
    with pytest.raises(GrammarError, match="longer than 1 s"):
        client.fetch(SLOW)  # the failure is cached: answered at once
    stats = ray.get(actor.stats.remote())
    assert stats["timeouts"] == 1 and stats["compiles"] == 5
    # the actor and its pool survive: a new compile still works
    assert "error" not in envelope.read_header(ray.get(actor.get.remote(spec(9).to_dict(), fp)))


def test_bad_grammar_error_is_cached(actor_name):
    actor = new_actor(actor_name)
    client = GrammarCacheClient(tiny_info(), name=actor_name)
    bad = GrammarSpec.regex("(unclosed")
    for _ in range(2):
        with pytest.raises(GrammarError, match="invalid regex grammar"):
            client.fetch(bad)
    stats = ray.get(actor.stats.remote())
    assert stats["compiles"] == 1 and stats["errors"] == 1 and stats["hits"] == 1


def test_actor_down_falls_back_then_back_in_use(actor_name):
    actor = new_actor(actor_name)
    client = GrammarCacheClient(tiny_info(), name=actor_name,
                                limits=CompileLimits(timeout_s=10, processes=1))
    try:
        client.fetch(spec(0))
        assert client.counts["local"] == 0
        ray.kill(actor, no_restart=True)
        compiled = client.fetch(spec(1))  # still served: compiled locally
        assert xgr.GrammarMatcher(compiled).accept_string('{"p1":1}')
        assert client.counts["local"] == 1
        actor = new_actor(actor_name)  # the cache is back under its name
        client.fetch(spec(2))
        assert client.counts["actor"] + client.counts["verdict"] == 2
        assert client.counts["local"] == 1
        assert ray.get(actor.stats.remote())["tokenizers"] == 1  # registered again
    finally:
        client.close()


def test_restarted_actor_is_used_again(actor_name):
    actor = new_actor(actor_name)
    client = GrammarCacheClient(tiny_info(), name=actor_name)
    client.fetch(spec(0))
    ray.kill(actor, no_restart=False)  # Ray restarts it (max_restarts=-1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the kill is asynchronous: wait for the new instance
        try:
            if ray.get(actor.stats.remote(), timeout=5)["compiles"] == 0:
                break
        except Exception:
            pass
        time.sleep(0.5)
    client.fetch(spec(1))
    stats = ray.get(actor.stats.remote())
    assert stats["compiles"] == 1 and stats["tokenizers"] == 1  # a fresh actor, used
    assert client.counts["actor"] + client.counts["verdict"] == 2


def test_local_verdict_compiles_in_process(actor_name):
    actor = new_actor(actor_name, local_verdict_factor=0.0)  # every grammar gets a verdict
    client = GrammarCacheClient(tiny_info(), name=actor_name)
    compiled = client.fetch(spec(3))
    assert xgr.GrammarMatcher(compiled).accept_string('{"p3":12}')
    assert client.counts == {"actor": 0, "verdict": 1, "local": 0}
    stats = ray.get(actor.stats.remote())
    assert stats["local_verdicts"] == 1 and stats["compiles"] == 1
    header = envelope.read_header(ray.get(actor.get.remote(spec(3).to_dict(), client.fingerprint)))
    assert header["local"] and "grammar" not in header  # small: no serialized grammar


def test_envelope_mismatch_is_caught():
    info = tiny_info()
    fp = tokenizer_fingerprint(info)
    compiled = xgr.GrammarCompiler(info).compile_regex("ab")
    data = envelope.pack(compiled, fp, "k")
    assert envelope.unpack(data, info, fp, "k") is not None
    with pytest.raises(envelope.EnvelopeMismatch, match="fp"):
        envelope.unpack(data, info, "another-tokenizer", "k")
    with pytest.raises(envelope.EnvelopeMismatch, match="key"):
        envelope.unpack(data, info, fp, "other-key")
    for field, value in [("v", 999), ("xgr", "0.0.1"), ("ser", "v0")]:
        env = msgpack.unpackb(data)
        env[field] = value
        with pytest.raises(envelope.EnvelopeMismatch, match=field):
            envelope.unpack(msgpack.packb(env), info, fp, "k")
    with pytest.raises(envelope.EnvelopeMismatch):
        envelope.unpack(msgpack.packb([1, 2]), info, fp)
    other = xgr.TokenizerInfo(VOCAB[:-1], stop_token_ids=[0])
    assert tokenizer_fingerprint(other) != fp


def test_byte_limit_evicts_least_recently_used():
    info = tiny_info()
    fp = tokenizer_fingerprint(info)
    # no compile-locally verdicts: every entry is a full envelope of about the same size
    cache = GrammarCache(GrammarCacheConfig(compile_processes=1,
                                            local_verdict_factor=float("inf")))
    cache.register_tokenizer(fp, info.serialize_json())

    async def get(i):
        return await cache.get(spec(i).to_dict(), fp)

    async def main():
        size = len(await get(0))
        cache.lru.max_bytes = int(size * 2.5)  # room for two entries of this size
        await get(1)
        await get(0)  # 0 is now the most recently used
        await get(2)  # over budget: 1 goes
        keys = [spec(i).key(fp) for i in range(3)]
        return [k in cache.lru for k in keys]

    try:
        assert asyncio.run(main()) == [True, False, True]
        stats = cache.stats()
        assert stats["evictions"] == 1 and stats["bytes"] <= stats["max_bytes"]
    finally:
        cache.close()


def test_engines_compile_through_the_shared_cache(actor_name, make_engine):
    from worker.engine.sampling import SamplingParams
    from worker.engine.sequence import GenerationRequest

    actor = new_actor(actor_name)
    engines = [make_engine(grammar_cache_actor=actor_name) for _ in range(2)]
    choice = GrammarSpec.choice(["red", "green", "blue"])
    for engine in engines:
        req = GenerationRequest([{"role": "user", "content": "Pick a color."}],
                                SamplingParams(max_new_tokens=8, temperature=0), grammar=choice)
        out = engine.generate([req])[req.request_id]
        assert out.text in ("red", "green", "blue")
    stats = ray.get(actor.stats.remote())
    assert stats["compiles"] == 1 and stats["hits"] == 1  # the second engine got a hit
