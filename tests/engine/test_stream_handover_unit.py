"""The hand-off from the engine thread to the event loops (worker/engine/async_engine.py)
and the worker's channels (worker/channel.py), without a model: a step's outputs cross in
one call per loop, a request that its consumer has not taken yet gathers its gain into one
chunk, and a channel sends one batch for every request that gained output."""

import asyncio

import pytest

from core.request import RequestOutput
from worker.channel import Channel
from worker.engine.async_engine import AsyncEngine, _Stream

pytestmark = pytest.mark.unit


class _IdleEngine:
    def has_work(self):
        return False


class _CountingLoop:
    def __init__(self):
        self.calls = []

    def call_soon_threadsafe(self, fn, *args):
        self.calls.append((fn, args))


def chunk(rid, tokens, finished=False, logprobs=None, **kw):
    return RequestOutput(rid, text="".join(f"<{t}>" for t in tokens), token_ids=list(tokens),
                         logprobs=logprobs, finished=finished, completion_tokens=tokens[-1]
                         if tokens else 0, **kw)


def test_a_steps_outputs_cross_in_one_call_per_loop():
    engine = AsyncEngine(_IdleEngine())
    try:
        a, b = _CountingLoop(), _CountingLoop()
        streams = {f"r{i}": _Stream(a if i < 3 else b) for i in range(4)}
        engine._streams.update(streams)
        engine._deliver([chunk(f"r{i}", [i]) for i in range(4)] + [chunk("gone", [9])])
        assert len(a.calls) == 1 and len(b.calls) == 1  # not one per chunk
        for loop in (a, b):
            fn, (batch,) = loop.calls[0]
            fn(batch)
        assert [streams[f"r{i}"].pending.token_ids for i in range(4)] == [[0], [1], [2], [3]]
    finally:
        engine.shutdown()


def test_a_lagging_consumer_takes_its_gain_as_one_chunk():
    async def main():
        stream = _Stream(asyncio.get_running_loop())
        stream.put(chunk("r", [1], logprobs=[(-0.1, [])]))
        stream.put(chunk("r", [2], logprobs=[None]))  # a forced token
        stream.put(chunk("r", [3], finished=True, finish_reason="length", logprobs=[(-0.3, [])],
                         validation="valid"))
        out = await stream.take()
        assert out.token_ids == [1, 2, 3] and out.text == "<1><2><3>"
        assert out.logprobs == [(-0.1, []), None, (-0.3, [])]
        assert out.finished and out.finish_reason == "length" and out.validation == "valid"
        assert out.completion_tokens == 3
        assert stream.take_now() is None
        # a consumer that keeps up gets each chunk as it comes
        waiting = asyncio.ensure_future(stream.take())
        await asyncio.sleep(0)
        stream.put(chunk("r", [4]))
        assert (await waiting).token_ids == [4]

    asyncio.run(main())


def test_a_channel_sends_one_batch_per_round_and_lets_finished_requests_go():
    class Req:
        def __init__(self, rid):
            self.request_id = rid

    async def main():
        loop = asyncio.get_running_loop()
        channel, closed = Channel("c"), []
        streams = {rid: _Stream(loop) for rid in ("a", "b", "c")}
        for rid, s in streams.items():
            channel.add(Req(rid), s)
        batches = channel.batches(closed.append)
        streams["a"].put(chunk("a", [1]))
        streams["a"].put(chunk("a", [2]))
        streams["b"].put(chunk("b", [7], finished=True, finish_reason="stop"))
        first = await batches.__anext__()
        assert [(r.request_id, out.token_ids) for r, out in first] == [("a", [1, 2]), ("b", [7])]
        assert closed == ["b"] and sorted(channel.request_ids()) == ["a", "c"]
        nxt = asyncio.ensure_future(batches.__anext__())
        await asyncio.sleep(0)
        assert not nxt.done()  # nothing gained: nothing sent
        streams["c"].put(chunk("c", [5]))
        assert [(r.request_id, out.token_ids) for r, out in await nxt] == [("c", [5])]
        await batches.aclose()

    asyncio.run(main())
