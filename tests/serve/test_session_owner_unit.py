"""Sessions belong to the client that made them (deploy/openai_api.session_key), through
the server's request path with a fake runtime (no Ray):

- another client naming the same session id runs in a session of its own: it gets no
  ``cached_tokens`` from the first one's KV, and its DELETE is a 404 that ends nothing
  (the first client's running requests go on);
- the owner (its API key, and its ``user`` or else its address) ends its session with a
  200; a DELETE of a session it does not have is a 404.
"""

import asyncio
import json
from types import SimpleNamespace

import pytest

from core.request import RequestOutput
from deploy import openai_api as api
from deploy.errors import APIError
from tests.serve.fakes import SERVER, edge_server

pytestmark = pytest.mark.unit



class SessionRuntime:
    """A runtime that keeps each session's prompt, as a worker keeps its KV: a request in a
    session that already ran reports the shared prefix as ``cached_prompt_tokens``."""

    def __init__(self):
        self.sessions: dict[str, str] = {}
        self.requests, self.ended = [], []

    async def generate(self, request):
        self.requests.append(request)
        prompt = json.dumps(request.prompt)
        cached = 0
        kept = self.sessions.get(request.session_id) if request.session_id else None
        if kept is not None:
            while cached < min(len(kept), len(prompt)) and kept[cached] == prompt[cached]:
                cached += 1
        if request.session_id:
            self.sessions[request.session_id] = prompt
        yield RequestOutput(request.request_id, text="ok", token_ids=[1], finished=True,
                            finish_reason="stop", prompt_tokens=len(prompt),
                            completion_tokens=1, cached_tokens=cached)

    async def end_session(self, session_id):
        self.ended.append(session_id)
        return self.sessions.pop(session_id, None) is not None


def server(**settings):
    return edge_server(SessionRuntime(), **settings)


def request(body=None, host="10.1.2.3", key=None, query=None):
    raw = json.dumps(body or {}).encode()

    async def stream():
        yield raw
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return SimpleNamespace(headers=headers, client=SimpleNamespace(host=host),
                           url=SimpleNamespace(path="/v1/chat/completions"), stream=stream,
                           query_params=query or {})


def chat(srv, content, sid="conv-1", **kw):
    body = {"messages": [{"role": "user", "content": content}], "session_id": sid,
            **kw.pop("body", {})}
    out = asyncio.run(srv._serve(request(body, **kw), api.ChatCompletionRequest,
                                 api.plan_chat))
    return out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def delete(srv, sid="conv-1", **kw):
    return asyncio.run(SERVER.end_session(srv, sid, request(**kw)))


SECRET = "the secret plan is to meet at noon by the old mill"


def test_a_stranger_gets_no_cached_tokens_from_anothers_session():
    srv = server()
    chat(srv, SECRET, host="10.0.0.1")
    assert chat(srv, SECRET, host="10.0.0.1") > 0  # the owner's next turn reuses its KV
    assert chat(srv, SECRET + " at noon", host="10.0.0.66") == 0  # a stranger: nothing
    a, b = {r.session_id for r in srv.runtime.requests}
    assert a != b and a.endswith(":conv-1") and b.endswith(":conv-1")


def test_a_stranger_cannot_end_anothers_session():
    srv = server(api_key="k")
    chat(srv, "hello", host="10.0.0.1", key="k")
    with pytest.raises(APIError) as err:
        delete(srv, host="10.0.0.66", key="k")
    assert err.value.status == 404 and err.value.param == "session_id"
    assert err.value.code == "session_not_found"
    assert len(srv.runtime.sessions) == 1  # the owner's session lives on
    assert delete(srv, host="10.0.0.1", key="k")["deleted"] is True
    assert not srv.runtime.sessions
    with pytest.raises(APIError) as err:  # gone now: the owner gets a 404 too
        delete(srv, host="10.0.0.1", key="k")
    assert err.value.status == 404


def test_a_session_made_with_user_is_ended_with_that_user():
    srv = server(api_key="k")
    chat(srv, "hello", host="10.0.0.1", key="k", body={"user": "alice"})
    with pytest.raises(APIError):
        delete(srv, host="10.0.0.1", key="k")  # the address alone is another client
    with pytest.raises(APIError):
        delete(srv, host="10.0.0.1", key="k", query={"user": "bob"})
    assert delete(srv, host="10.0.0.9", key="k", query={"user": "alice"})["deleted"]


def test_plans_without_a_client_keep_the_id():
    plan = api.plan_chat(api.parse_request(api.ChatCompletionRequest, {
        "messages": [{"role": "user", "content": "x"}], "session_id": "s"}), api.Limits())
    assert plan.requests[0].session_id == "s"
    plan = api.plan_chat(api.parse_request(api.ChatCompletionRequest, {
        "messages": [{"role": "user", "content": "x"}], "session_id": "s", "n": 2}),
        api.Limits(), client="c")
    assert {r.session_id for r in plan.requests} == {"c:s"} and plan.temp_session is None
