"""RuntimeClient's failover decisions with a fake worker handle (no Ray): a worker that dies
after streaming a request's last token, before its final chunk, ends the stream with a
WORKER_DIED error (a resend helps), not with a continuation the next worker would refuse
as a bad request (a batch job counted such a row "refused": test_batch_account_job)."""

import asyncio

import pytest
from ray.exceptions import ActorDiedError

from cluster.client import RuntimeClient
from core.errors import ErrorKind
from core.params import SamplingParams
from core.request import GenerationRequest, RequestOutput

pytestmark = pytest.mark.unit


class _Method:
    def __init__(self, fn):
        self.remote = fn


class _DyingWorker:
    """Streams ``tokens`` one chunk each, none final, then dies (a continuation: dies at
    once)."""

    def __init__(self, tokens):
        self.requests = []

        def generate(req):
            self.requests.append(req)

            async def stream():
                for t in ([] if req.resume_token_ids else tokens):
                    ref = asyncio.get_running_loop().create_future()
                    ref.set_result(RequestOutput(req.request_id, token_ids=[t], text="x"))
                    yield ref
                raise ActorDiedError()
            return stream()

        self.generate = _Method(generate)
        self.abort = _Method(lambda request_id: None)


def run(client, request):
    async def collect():
        return [c async for c in client.generate(request)]
    return asyncio.run(collect())


def client_over(worker):
    client = RuntimeClient(scheduler=object())

    async def route(*args):
        return {"worker_id": "w0", "handle": worker}

    async def reported(worker_id):
        return None

    client._route_after_deaths, client._report_failed = route, reported
    return client


@pytest.mark.parametrize("streamed, budget, continued", [(4, 4, False), (3, 4, True)],
                         ids=["after-the-last-token", "mid-stream"])
def test_a_death_after_the_last_token_is_not_continued(streamed, budget, continued):
    worker = _DyingWorker(list(range(10, 10 + streamed)))
    client = client_over(worker)
    request = GenerationRequest("hi", SamplingParams(max_new_tokens=budget))
    chunks = run(client, request)
    final = chunks[-1]
    assert final.finished and final.finish_reason == "error"
    assert final.error_kind == ErrorKind.WORKER_DIED
    resumed = [r for r in worker.requests if r.resume_token_ids]
    if continued:  # the fake dies again on each continuation, until failovers run out
        assert resumed and resumed[0].resume_token_ids == list(range(10, 10 + streamed))
        assert client.counts.failovers == client.max_failovers
    else:
        assert not resumed and client.counts.failovers == 0
        assert "last token" in final.error


def test_a_short_scheduler_outage_is_counted_after_it_ends():
    """The long poll fails once (the scheduler died) and answers again at once (restarted):
    ``scheduler_down`` is back to 0 before anyone reads it, but the outage is counted."""
    from ray.exceptions import ActorUnavailableError

    calls = []

    async def watch(timeout_s):
        calls.append(timeout_s)
        if len(calls) == 2:  # the first long poll: the scheduler dies under it
            raise ActorUnavailableError("restarting", None)
        if timeout_s:
            await asyncio.sleep(3600)  # an open long poll

    scheduler = type("Scheduler", (), {"watch": _Method(watch)})()
    client = RuntimeClient(scheduler=scheduler)

    async def run_watch():
        client._ensure_watching()
        while len(calls) < 4:  # up, poll (fails), up again, poll
            await asyncio.sleep(0.01)
        client._watcher.cancel()

    asyncio.run(run_watch())
    assert client.scheduler_down_since is None and client.stats().scheduler_down == 0
    assert client.counts.scheduler_outages == 1 == client.stats().scheduler_outages
