"""RuntimeClient over worker channels (cluster/channels.py) with fake worker handles (no
Ray): a front end's requests on one worker share one channel, each gets its own chunks,
a bad request fails at submit, and a channel that fails mid-stream (the worker died)
continues its requests on another worker from exactly the tokens they streamed."""

import asyncio
import copy

import pytest
from ray.exceptions import ActorDiedError

from cluster.client import RuntimeClient
from core.params import SamplingParams
from core.request import GenerationRequest, RequestOutput

pytestmark = pytest.mark.unit


class _Method:
    def __init__(self, fn):
        self.remote = fn


class _ChannelWorker:
    """``script(request)``: what the worker sends for a request, in order: lists of chunks
    (one batch each) or an exception (the channel fails with it)."""

    def __init__(self, worker_id, script):
        self.worker_id, self.script = worker_id, script
        self._actor_id = f"actor-{worker_id}"
        self.requests, self.channels, self.aborted = [], [], []
        self.queue = asyncio.Queue()
        self.submit = _Method(self._submit)
        self.channel = _Method(self._channel)
        self.abort = _Method(self.aborted.append)

    async def _submit(self, request, channel_id):
        self.submitted_to = getattr(self, "submitted_to", set()) | {channel_id}
        if request.params.max_new_tokens > 100:
            raise ValueError("max_new_tokens is over the context")
        self.requests.append(request)
        for item in self.script(request):
            self.queue.put_nowait(item)

    def _channel(self, channel_id):
        self.channels.append(channel_id)

        async def batches():
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                ref = asyncio.get_running_loop().create_future()
                ref.set_result(item)
                yield ref
        return batches()


def out(request, tokens, finished=False):
    return RequestOutput(request.request_id, text="".join(f"<{t}>" for t in tokens),
                         token_ids=list(tokens), finished=finished,
                         finish_reason="length" if finished else None)


def client_over(*workers):
    client = RuntimeClient(scheduler=object())

    async def route(session_id, expected, family, died_on, keys=None):
        live = [w for w in workers if w.worker_id not in died_on]
        # each route brings its own handle object for the same actor, as Ray's do
        return {"worker_id": live[0].worker_id, "handle": copy.copy(live[0])}

    async def reported(worker_id):
        return None

    client._route_after_deaths, client._report_failed = route, reported
    return client


def request(n=4):
    return GenerationRequest("hi", SamplingParams(max_new_tokens=n))


def test_requests_on_one_worker_share_its_channel():
    worker = _ChannelWorker("w0", lambda r: [[out(r, [1])], [out(r, [2, 3], finished=True)]])
    client = client_over(worker)

    async def main():
        return await asyncio.gather(*(client.complete(request()) for _ in range(3)))

    outs = asyncio.run(main())
    assert [o.token_ids for o in outs] == [[1, 2, 3]] * 3
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    # one channel, not one stream per request
    assert len(worker.channels) == 1 and worker.submitted_to == set(worker.channels)
    assert not worker.aborted


def test_a_bad_request_fails_at_submit_and_leaves_no_inbox():
    worker = _ChannelWorker("w0", lambda r: [])
    client = client_over(worker)

    async def main():
        with pytest.raises(ValueError, match="max_new_tokens"):
            await client.complete(request(n=1000))
        return client._channels["w0"].inboxes

    assert asyncio.run(main()) == {}


def test_a_failed_channel_continues_from_exactly_the_streamed_tokens():
    def dying(r):
        return [[out(r, [10])], [out(r, [11, 12])], ActorDiedError()]

    def resuming(r):
        return [[out(r, [13], finished=True)]]

    first, second = _ChannelWorker("w0", dying), _ChannelWorker("w1", resuming)
    client = client_over(first, second)
    original = request(n=4)

    async def main():
        return [c async for c in client.generate(original)]

    chunks = asyncio.run(main())
    assert [t for c in chunks for t in c.token_ids] == [10, 11, 12, 13]
    assert "".join(c.text for c in chunks) == "<10><11><12><13>"
    assert chunks[-1].finished and {c.request_id for c in chunks} == {original.request_id}
    (continued,) = second.requests
    assert continued.resume_token_ids == [10, 11, 12]
    assert continued.resume_text == "<10><11><12>"
    assert client.counts.failovers == 1 and client.counts.resumed_tokens == 3
