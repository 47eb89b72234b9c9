"""Mid-stream failover: a request whose worker dies after it streamed tokens continues on
another worker from where it stopped (the tokens streamed so far are resumed: KV recomputed,
matcher advanced, nothing emitted twice), and a scheduler restart does not make callers
wait.

The engine-level test checks that a continuation is faithful (greedy: the resumed run ends
exactly like the uninterrupted one); the Ray tests kill real worker and scheduler actors."""

import asyncio
import json
import re
import time

import jsonschema
import pytest
import ray

from cluster import launch
from cluster.client import RuntimeClient
from core.grammar_spec import GrammarSpec
from core.params import SamplingParams
from core.request import GenerationRequest
from cluster.config import ClusterConfig

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "population": {"type": "integer"}},
          "required": ["city", "population"]}


@pytest.mark.integration
def test_a_continuation_ends_like_the_uninterrupted_run(make_engine):
    engine = make_engine()
    prompt = [{"role": "user", "content": "A city and its population, as JSON."}]
    params = SamplingParams(max_new_tokens=48, temperature=0.0)
    grammar = GrammarSpec.json_schema(SCHEMA)
    whole = engine.generate([GenerationRequest(prompt, params, request_id="whole",
                                               grammar=grammar)])["whole"]
    assert whole.finish_reason == "stop" and len(whole.token_ids) > 6
    cut = len(whole.token_ids) // 2
    cont = engine.generate([GenerationRequest(
        prompt, params, request_id="cont", grammar=grammar,
        resume_token_ids=whole.token_ids[:cut])])["cont"]
    assert cont.token_ids == whole.token_ids[cut:]  # nothing emitted twice, nothing lost
    assert engine.tokenizer.decode(whole.token_ids[:cut]) + cont.text == whole.text
    assert cont.completion_tokens == whole.completion_tokens  # usage counts the whole output
    assert cont.finish_reason == "stop" and cont.validation == "valid"
    jsonschema.validate(json.loads(whole.text), SCHEMA)


@pytest.mark.integration
def test_a_continuation_is_never_refused_for_its_budget(make_engine):
    # resumed one token before max_tokens inside a value: the grammar needs several more
    # to close. A fresh request in that state would be a 400 (budget too small); a
    # continuation (a worker died under it, the client has its tokens) goes on and ends
    # at the budget, flagged, as the uninterrupted request would have
    engine = make_engine()
    grammar = GrammarSpec.json_schema(SCHEMA)
    prefix = engine.tokenizer('{"city": "Par', add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=len(prefix) + 1, temperature=0.0)
    out = engine.generate([GenerationRequest("A city.", params, request_id="c",
                                             grammar=grammar, resume_token_ids=prefix)])["c"]
    assert out.finish_reason == "length", (out.finish_reason, out.error)
    assert out.validation == "invalid" and len(out.token_ids) == 1
    fresh = engine.generate([GenerationRequest("A city.", SamplingParams(max_new_tokens=1),
                                               request_id="f", grammar=grammar)])["f"]
    assert fresh.finish_reason == "error" and fresh.error_kind.value == "budget_too_small"


@pytest.mark.integration
def test_a_continuation_the_grammar_refuses_is_a_clear_error(make_engine):
    engine = make_engine()
    bad = engine.tokenizer("hello", add_special_tokens=False)["input_ids"]
    out = engine.generate([GenerationRequest(
        "x", SamplingParams(max_new_tokens=16), request_id="r",
        grammar=GrammarSpec.regex("[0-9]+"), resume_token_ids=bad)])["r"]
    assert out.finish_reason == "error" and "cannot resume" in out.error
    assert out.error_kind.value == "worker_died"
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request(GenerationRequest("x", SamplingParams(max_new_tokens=2),
                                             resume_token_ids=bad * 2))


@pytest.fixture(scope="module")
def runtime(tiny_model_dir, shared_ray):
    config = ClusterConfig(model=str(tiny_model_dir), num_workers=2,
                           worker={"num_cpus": 1, "num_threads": 1},
                           engine={"num_kv_blocks": 256, "max_model_len": 1024},
                           scheduler={"load_poll_interval_s": 0.3})
    with shared_ray():  # Ray with fast death notices, as rayguide serve / up start it
        yield launch.up(config)


@pytest.mark.integration
def test_a_worker_killed_mid_stream_costs_only_a_pause(runtime):
    pattern = "[a-z]{300}"
    request = GenerationRequest([{"role": "user", "content": "Letters."}],
                                SamplingParams(max_new_tokens=400, temperature=1.0),
                                grammar=GrammarSpec.regex(pattern))
    client = RuntimeClient()

    async def run():
        chunks, killed, gaps, last = [], None, [], time.monotonic()
        async for chunk in client.generate(request):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            chunks.append(chunk)
            if killed is None and len(chunks) == 5:
                killed = chunk.worker_id
                ray.kill(ray.get_actor(f"rayguide_worker_{killed[1:]}", namespace="rayguide"),
                         no_restart=False)
        return chunks, killed, max(gaps)

    chunks, killed, pause = asyncio.run(run())
    final = chunks[-1]
    text = "".join(c.text for c in chunks)
    assert final.finished and final.finish_reason in ("stop", "length"), final
    assert final.request_id == request.request_id
    assert re.fullmatch(pattern, text), text  # whole, valid, nothing twice
    assert sum(len(c.token_ids) for c in chunks) == final.completion_tokens
    assert client.counts.failovers == 1 and client.counts.resumed_tokens >= 5
    assert {c.worker_id for c in chunks[6:]} - {killed}  # the rest came from another worker
    print(f"\nfailover: longest pause a caller saw {pause * 1000:.0f} ms")


@pytest.mark.integration
def test_concurrent_streams_survive_a_worker_kill(runtime):
    """Eight guided streams at once over both workers; the worker serving the first one is
    killed once every stream has output: no request fails and every answer is whole and
    valid. The streams on the dead worker continue on the other one, or, when the other
    is itself still restarting (the previous test killed it), wait for a worker to answer
    again instead of spending their failovers on restarting ones."""
    launch._wait_registered(launch.handles()["scheduler"], 2)
    pattern = "[a-z]{300}"
    client = RuntimeClient()

    async def run():
        outputs: dict[int, list] = {i: [] for i in range(8)}

        async def one(i):
            request = GenerationRequest([{"role": "user", "content": f"Letters {i}."}],
                                        SamplingParams(max_new_tokens=400, temperature=1.0),
                                        grammar=GrammarSpec.regex(pattern))
            async for chunk in client.generate(request):
                outputs[i].append(chunk)

        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        deadline = time.monotonic() + 120
        while not all(outputs.values()) and not any(t.done() for t in tasks):
            assert time.monotonic() < deadline, "the streams did not start"
            await asyncio.sleep(0.01)
        victim = outputs[0][0].worker_id
        moved = [i for i, chunks in outputs.items()
                 if chunks and chunks[0].worker_id == victim and not chunks[-1].finished]
        ray.kill(ray.get_actor(f"rayguide_worker_{victim[1:]}", namespace="rayguide"),
                 no_restart=False)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return outputs, results, moved

    outputs, results, moved = asyncio.run(run())
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert moved, "no stream was still running on the killed worker: the test proved nothing"
    for chunks in outputs.values():
        final = chunks[-1]
        assert final.finished and final.finish_reason in ("stop", "length"), (final.error, len(chunks))
        assert re.fullmatch(pattern, "".join(c.text for c in chunks))  # whole, valid, once
        assert sum(len(c.token_ids) for c in chunks) == final.completion_tokens
    assert client.counts.failovers >= 1  # (a stream in `moved` may end as the kill lands)
    print(f"\n8 concurrent streams, a worker killed: {len(moved)} were on it and continued, "
          f"0 failed, longest failover pause {max(client.failover_pauses) * 1000:.0f} ms")


@pytest.mark.integration
def test_callers_do_not_wait_for_a_restarting_scheduler(runtime):
    client = RuntimeClient()

    async def one(session):
        return await client.complete(GenerationRequest(
            "Hello", SamplingParams(max_new_tokens=4), session_id=session))

    async def run():
        first = await one("sticky")
        assert first.finish_reason in ("stop", "length")
        assert client.scheduler_down_since is None
        ray.kill(launch.handles()["scheduler"], no_restart=False)  # Ray restarts it
        t = time.monotonic()
        again = await one("sticky")
        new = await one(None)
        served = time.monotonic() - t
        # the client's long poll fails. (Counted, not read from scheduler_down_since: on a busy
        # machine the two requests above can outlast the whole restart, down and up again.)
        while client.counts.scheduler_outages == 0:
            assert time.monotonic() - t < 20, "the client did not notice the scheduler died"
            await asyncio.sleep(0.01)
        noticed = time.monotonic() - t
        # ray.kill is asynchronous: under load both requests above may have been routed by the
        # old scheduler before it died. One more while it is known down must not ask it (if the
        # restart is already over, the new scheduler routes it).
        third = await one("sticky")
        while client.scheduler_down_since is not None:  # and it sees the new one come up
            assert time.monotonic() - t < 40, "the client did not see the scheduler return"
            await asyncio.sleep(0.05)
        return first, again, new, third, served, noticed, time.monotonic() - t

    first, again, new, third, served, noticed, back = asyncio.run(run())
    assert again.worker_id == first.worker_id == third.worker_id  # the session stayed put
    assert new.finish_reason in ("stop", "length") and third.finish_reason in ("stop", "length")
    # routed from what the client knew (at least the third, sent while the scheduler was known
    # down); at most one route call waited for its timeout
    assert client.counts.own_routes >= 1 and client.counts.route_timeouts <= 1
    print(f"\nscheduler restart: two requests served {served:.2f} s after the kill "
          f"(route timeouts: {client.counts.route_timeouts}); death noticed within "
          f"{noticed:.2f} s, the scheduler back after {back:.2f} s")
    deadline = time.monotonic() + 30  # the restarted scheduler rebuilds its tables
    while True:
        try:
            stats = ray.get(launch.handles()["scheduler"].stats.remote())
            if len(stats["workers"]) == 2:
                assert stats["rebuild_s"] is not None
                print(f"rebuild of the routing table: {stats['rebuild_s'] * 1000:.0f} ms")
                break
        except ray.exceptions.ActorUnavailableError:
            pass  # still restarting
        assert time.monotonic() < deadline, "the scheduler did not rebuild its tables"
        time.sleep(0.2)
