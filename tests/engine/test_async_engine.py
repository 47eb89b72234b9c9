"""AsyncEngine: concurrent streams, validation errors, abort on early exit, session end."""

import asyncio
import threading

import pytest

from core.grammar_spec import GrammarSpec
from worker.engine.async_engine import AsyncEngine
from worker.engine.sampling import SamplingParams
from core.request import GenerationRequest

pytestmark = pytest.mark.integration


def chat(text):
    return [{"role": "user", "content": text}]


@pytest.fixture
def aengine(make_engine):
    engine = AsyncEngine(make_engine())
    yield engine
    engine.shutdown()


async def collect(engine, req):
    chunks = [c async for c in engine.generate(req)]
    return chunks


def test_concurrent_streams(aengine):
    async def main():
        reqs = [GenerationRequest(chat(f"Count to {i}."), SamplingParams(max_new_tokens=12 + i,
                                                                         temperature=0))
                for i in range(4)]
        reqs.append(GenerationRequest(chat("yes or no?"), SamplingParams(max_new_tokens=8),
                                      grammar=GrammarSpec.choice(["yes", "no"])))
        results = await asyncio.gather(*(collect(aengine, r) for r in reqs))
        for chunks in results:
            assert chunks[-1].finished and all(not c.finished for c in chunks[:-1])
        assert "".join(c.text for c in results[-1]) in ("yes", "no")
        stats = await aengine.stats()
        assert stats.running == 0 and stats.live_processors == 0

    asyncio.run(main())


def test_bad_request_raises_before_streaming(aengine):
    async def main():
        with pytest.raises(ValueError, match="prompt is empty"):
            await collect(aengine, GenerationRequest("", SamplingParams()))
        ok = await collect(aengine, GenerationRequest(chat("hi"), SamplingParams(max_new_tokens=4)))
        assert ok[-1].finished

    asyncio.run(main())


def test_prompts_are_tokenized_off_the_engine_loop(aengine):
    # a long prompt tokenized on the engine loop held every other request's next token
    engine = aengine.engine
    threads, encode = [], engine.encode_prompt

    def spy(prompt):
        threads.append(threading.current_thread().name)
        return encode(prompt)
    engine.encode_prompt = spy

    async def main():
        out = await collect(aengine, GenerationRequest(chat("hi"), SamplingParams(max_new_tokens=4)))
        assert out[-1].finished
        with pytest.raises(ValueError, match="prompt is empty"):
            await collect(aengine, GenerationRequest("", SamplingParams()))

    asyncio.run(main())
    assert len(threads) == 2 and "engine-loop" not in threads, threads


def test_leaving_early_aborts_and_frees(aengine):
    async def main():
        req = GenerationRequest(chat("Write a long essay."), SamplingParams(max_new_tokens=200),
                                grammar=GrammarSpec.json_object())
        async for chunk in aengine.generate(req):
            if chunk.token_ids:
                break  # the client went away
        for _ in range(100):
            stats = await aengine.stats()
            if stats.running == 0 and stats.live_processors == 0:
                break
            await asyncio.sleep(0.05)
        assert stats.running == 0 and stats.live_processors == 0
        assert stats.free_blocks == stats.total_blocks

    asyncio.run(main())


def test_end_session_aborts_its_stream(aengine):
    async def main():
        req = GenerationRequest(chat("Write a long essay."), SamplingParams(max_new_tokens=200),
                                session_id="sess")
        chunks = []
        async for chunk in aengine.generate(req):
            chunks.append(chunk)
            if len(chunks) == 2:
                aengine.end_session("sess")
        assert chunks[-1].finish_reason == "abort"
        stats = await aengine.stats()
        assert stats.live_sessions == 0 and stats.free_blocks == stats.total_blocks

    asyncio.run(main())


def test_a_step_that_raises_fails_its_requests_instead_of_hanging(aengine):
    engine = aengine.engine
    real = engine.scheduler.schedule
    calls = {"n": 0}

    def broken():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real()

    engine.scheduler.schedule = broken

    async def main():
        return await asyncio.wait_for(collect(aengine, GenerationRequest(
            chat("Hello"), SamplingParams(max_new_tokens=16))), timeout=60)

    chunks = asyncio.run(main())
    last = chunks[-1]
    assert last.finished and last.finish_reason == "error" and "boom" in last.error
    assert last.error_kind.value == "internal"
    engine.scheduler.schedule = real
    assert engine.stats().running == 0 and engine.stats().live_processors == 0
    # and the engine goes on serving
    chunks = asyncio.run(collect(aengine, GenerationRequest(chat("Hi"),
                                                            SamplingParams(max_new_tokens=4))))
    assert chunks[-1].finish_reason in ("stop", "length")
