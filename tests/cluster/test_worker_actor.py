"""The runtime on a local Ray instance with the real default model: a WorkerActor's
streaming, guided requests, bad input, session end releasing everything, load reports; and
one request through the whole path (scheduler, worker, shared grammar cache)."""

import asyncio
import json

import jsonschema
import pytest
import ray

from cluster import launch
from cluster.client import RuntimeClient
from cluster.config import ClusterConfig
from core.grammar_spec import GrammarSpec
from core.params import SamplingParams
from core.request import GenerationRequest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runtime(default_model_dir, shared_ray):
    config = ClusterConfig(num_workers=1, worker={"num_cpus": 1, "num_threads": 1},
                           # xgrammar: the engine the shared cache serves (its compiles are counted)
                           engine={"num_kv_blocks": 256, "grammar_engine": "xgrammar"},
                           scheduler={"session_idle_timeout_s": 5.0, "load_poll_interval_s": 0.5})
    with shared_ray():
        yield launch.up(config)


@pytest.fixture
def worker(runtime):
    return runtime["workers"][0]


def chat(text):
    return [{"role": "user", "content": text}]


def stream(actor, request):
    return [ray.get(ref) for ref in actor.generate.remote(request)]


def req(prompt, max_new_tokens=16, grammar=None, session_id=None, **params):
    return GenerationRequest(prompt, SamplingParams(max_new_tokens=max_new_tokens, **params),
                             session_id=session_id, grammar=grammar)


def test_streams_chunks(worker):
    chunks = stream(worker, req(chat("Count from one to five."), 16, temperature=0.0))
    assert len(chunks) > 2 and chunks[-1].finished
    assert not any(c.finished for c in chunks[:-1])
    assert "".join(c.text for c in chunks).strip()
    assert {c.worker_id for c in chunks} == {"w0"}


def test_guided_request(worker):
    chunks = stream(worker, req(chat("Is ice cold?"), 8,
                                grammar=GrammarSpec.choice(["yes", "no"])))
    assert "".join(c.text for c in chunks) in ("yes", "no")


def test_load_reports_llguidance_grammars_as_cheap(worker):
    """Grammar-affinity routing reads these: a grammar llguidance serves is reported cheap
    (no affinity: it compiles here in a millisecond), an xgrammar one as held."""
    schema = {"type": "object", "properties": {"cheap": {"type": "boolean"}},
              "required": ["cheap"]}
    ll = GrammarSpec.json_schema(schema, engine="llguidance")
    xg = GrammarSpec.json_schema({**schema, "title": "held"}, engine="xgrammar")
    for spec in (ll, xg):
        chunks = stream(worker, req(chat("Is it cheap?"), 16, grammar=spec))
        assert chunks[-1].finished and chunks[-1].error is None
    load = ray.get(worker.load.remote())
    assert ll.family in load["cheap_grammar_families"]
    assert ll.family not in load["grammar_families"]
    assert xg.family in load["grammar_families"]
    assert xg.family not in load["cheap_grammar_families"]


def test_bad_request_raises(worker):
    with pytest.raises(ValueError, match="prompt is empty"):
        stream(worker, req(""))
    with pytest.raises(ValueError, match="GenerationRequest"):
        stream(worker, {"prompt": "x", "colour": "red"})


def test_end_sessions_releases_everything(worker):
    for sid in ("a", "b"):
        stream(worker, req(chat("Hello"), 4, session_id=sid,
                           grammar=GrammarSpec.regex("[a-z]{1,8}")))
    load = ray.get(worker.load.remote())
    assert load["live_sessions"] == 2 and load["worker_id"] == "w0" and load["node_id"]
    assert ray.get(worker.end_sessions.remote(["a", "b"])) == 2
    load = ray.get(worker.load.remote())
    assert load["live_sessions"] == 0 and load["live_processors"] == 0
    assert load["free_blocks"] == load["total_blocks"]


def test_whole_path_with_the_default_model(runtime):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"]}
    request = req(chat("Name a city and its country as JSON."), 48, session_id="whole",
                  temperature=0.0, grammar=GrammarSpec.json_schema(schema))
    client = RuntimeClient()
    compiles = ray.get(runtime["cache"].stats.remote())["compiles"]
    out = asyncio.run(client.complete(request))
    assert out.finish_reason == "stop", out
    jsonschema.validate(json.loads(out.text), schema)
    assert ray.get(runtime["cache"].stats.remote())["compiles"] == compiles + 1
    asyncio.run(client.end_session("whole"))
    ray.get(runtime["scheduler"].flush.remote())
    load = ray.get(runtime["workers"][0].load.remote())
    assert load["live_sessions"] == 0 and load["live_processors"] == 0


def test_forgotten_sessions_end_after_the_idle_timeout(runtime):
    import time

    client = RuntimeClient()
    asyncio.run(client.complete(req(chat("Hi"), 4, session_id="forgotten")))
    worker = runtime["workers"][0]
    assert "forgotten" in ray.get(worker.load.remote())["session_ids"]
    deadline = time.monotonic() + 30
    while "forgotten" in ray.get(worker.load.remote())["session_ids"]:
        assert time.monotonic() < deadline, "the idle session was never ended"
        time.sleep(0.5)
    load = ray.get(worker.load.remote())
    assert load["free_blocks"] == load["total_blocks"]



def test_a_channel_carries_several_requests_in_batches(worker):
    """A front end's requests share one channel (WorkerActor.submit / channel): each item
    is a batch with a chunk for every request that gained output, and every request
    arrives whole; a bad request fails at submit; an aborted one ends "abort"."""
    async def main():
        channel_id = "test-channel"
        batches = worker.channel.remote(channel_id)
        reqs = [req(chat(f"Count to {k}."), 12, temperature=0.0, ignore_eos=True)
                for k in (3, 4, 5)]
        for r in reqs:
            await worker.submit.remote(r, channel_id)
        with pytest.raises(ValueError, match="prompt is empty"):
            await worker.submit.remote(req(""), channel_id)
        long = req(chat("Write a long essay."), 200, ignore_eos=True)
        await worker.submit.remote(long, channel_id)
        got = {r.request_id: [] for r in reqs + [long]}
        sizes = []
        async for ref in batches:
            batch = await ref
            sizes.append(len(batch))
            for out in batch:
                got[out.request_id].append(out)
                if out.request_id == long.request_id and len(got[long.request_id]) == 2:
                    await worker.abort.remote(long.request_id)
            if all(c and c[-1].finished for c in got.values()):
                break
        return got, sizes

    got, sizes = asyncio.run(main())
    assert max(sizes) > 1  # a batch held several requests' chunks
    *whole, aborted = got.values()
    for chunks in whole:
        assert sum(len(c.token_ids) for c in chunks) == 12 == chunks[-1].completion_tokens
        assert chunks[-1].finish_reason == "length" and not any(c.finished for c in chunks[:-1])
        assert {c.worker_id for c in chunks} == {"w0"}
    assert aborted[-1].finish_reason == "abort"
    load = ray.get(worker.load.remote())
    assert load["running"] == 0
