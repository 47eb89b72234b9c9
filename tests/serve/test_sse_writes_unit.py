"""The replica's SSE writer (deploy/serve_app.py ``_sse``) without Ray: what came from the
runtime while the last write was sent goes out as one write, each choice's chunks merged,
so a slow client gets fewer, larger events and the same text, finish and usage."""

import asyncio
import json

import pytest

import deploy.serve_app as serve_app
from core.request import RequestOutput
from deploy import openai_api as api
from deploy.metrics import Metrics
from deploy.settings import AppSettings, Limits

pytestmark = pytest.mark.unit

SERVER = getattr(serve_app.OpenAIServer, "func_or_class", serve_app.OpenAIServer)


def plan(n):
    body = {"messages": [{"role": "user", "content": "hi"}], "n": n, "stream": True,
            "stream_options": {"include_usage": True}}
    return api.plan_chat(api.parse_request(api.ChatCompletionRequest, body), Limits(),
                         api.Served(None, {}))


def server(**settings):
    s = SERVER.__new__(SERVER)
    s._metrics, s._models, s._open_streams = Metrics(), ["m"], 0
    s.settings = AppSettings(**settings)

    async def no_session(_plan):
        return None

    s._end_temp_session = no_session
    return s


async def stream_of(chunks):
    for c in chunks:
        yield c


def choice_chunks(rid, words):
    return [RequestOutput(rid, w, [k], finished=k == len(words) - 1,
                          finish_reason="length" if k == len(words) - 1 else None,
                          prompt_tokens=3, completion_tokens=k + 1)
            for k, w in enumerate(words)]


def test_what_waited_goes_out_as_one_write_per_round():
    p = plan(2)
    words = [["a", "b", "c", "d"], ["x", "y", "z"]]
    chunks = [choice_chunks(r.request_id, w) for r, w in zip(p.requests, words)]
    opened = [(stream_of(c[1:]), c[0]) for c in chunks]

    async def main():
        writes = []
        async for write in server()._sse(p, opened, 0.0):
            writes.append(write)
            await asyncio.sleep(0)  # the client takes its time: the chunks wait meanwhile
        return writes

    writes = asyncio.run(main())
    events = [json.loads(e[len("data: "):]) for w in writes
              for e in w.split("\n\n") if e.startswith("data: {")]
    content_events = [e for e in events if e["choices"] and e["choices"][0]["delta"].get(
        "content")]
    assert len(content_events) < sum(map(len, words))  # merged, not one event a chunk
    for i, w in enumerate(words):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content", "") for c in mine) == "".join(w)
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == 7
    assert writes[-1].endswith("data: [DONE]\n\n")


def test_drain_merges_each_choice_in_the_order_it_came():
    queue = asyncio.Queue()
    for item in [(1, RequestOutput("b", "y", [2])), (0, RequestOutput("a", "q", [3])),
                 (1, RequestOutput("b", "z", [4], finished=True))]:
        queue.put_nowait(item)
    gained = serve_app._drain((0, RequestOutput("a", "p", [1])), queue)
    assert list(gained) == [0, 1] and queue.empty()
    assert (gained[0].text, gained[0].token_ids) == ("pq", [1, 3])
    assert (gained[1].text, gained[1].token_ids, gained[1].finished) == ("yz", [2, 4], True)


def test_the_write_gap_is_the_other_streams_share_capped_by_the_interval():
    s = server(stream_events_per_s=1000, stream_interval_ms=50)
    s._open_streams = 1
    assert s._write_gap() == 0.0  # a lone stream: every token as it comes
    s._open_streams = 21
    assert s._write_gap() == pytest.approx(0.02)
    s._open_streams = 256
    assert s._write_gap() == pytest.approx(0.05)  # never longer than the interval


def test_a_stream_that_waits_for_its_gap_sends_its_gain_in_one_write():
    """With a gap of the whole interval, the first token goes out at once and the rest in
    fewer writes than chunks (the runtime client's inbox merges what waits upstream; this
    fake stream does not, so the bounded hand-over queue holds at most one chunk)."""
    p = plan(1)
    words = ["a", "b", "c", "d", "e"]
    (req,) = p.requests
    chunks = choice_chunks(req.request_id, words)

    async def slow(rest):
        for c in rest:
            await asyncio.sleep(0)
            yield c

    async def main():
        s = server(stream_events_per_s=1e-3, stream_interval_ms=200)
        s._open_streams = 1  # another stream is open: this one waits its gap
        return [w async for w in s._sse(p, [(slow(chunks[1:]), chunks[0])], 0.0)]

    writes = asyncio.run(main())
    content = [w for w in writes if '"content": "' in w and '"content": ""' not in w]
    texts = [json.loads(w[len("data: "):])["choices"][0]["delta"]["content"] for w in content]
    assert texts[0] == "a" and "".join(texts) == "abcde" and len(texts) < len(words)
