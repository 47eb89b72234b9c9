"""The edge under hostile or unlucky conditions, without Ray: a scheduler that is down or
hangs, a request whose failover continuation cannot run, a chat template that refuses the
messages, non-finite logprobs, session ids and choice counts past their limits, tool
definitions that inflate the prompt, and self-healing that never leaves the route unknown.
The server's methods run on an instance built around fakes (no replica, no runtime)."""

import asyncio
import json
import math
from pathlib import Path
import re
from types import SimpleNamespace

import jinja2
import pytest
from ray.exceptions import RayActorError, RayTaskError
from starlette.responses import JSONResponse

from core.errors import NoWorkers
from core.request import RequestOutput
from deploy import openai_api as api, responses
from deploy.errors import APIError, for_exception
from deploy.settings import AppSettings, Limits
from tests.serve.fakes import SERVER, edge_server

pytestmark = pytest.mark.unit

LIMITS = Limits()


def chat(limits=LIMITS, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return api.plan_chat(api.parse_request(api.ChatCompletionRequest, body), limits)


def completion(limits=LIMITS, **body):
    return api.plan_completion(api.parse_request(api.CompletionRequest, body), limits)


def remote_error(cause: BaseException) -> BaseException:
    """An exception as it comes out of a Ray actor task."""
    return RayTaskError("generate", "Traceback (remote)", cause).as_instanceof_cause()


class Call:
    """``actor.method.remote()``: an awaitable that answers, raises, or never returns."""

    def __init__(self, answer=None, error=None, hang=False):
        self.answer, self.error, self.hang = answer, error, hang

    async def _run(self):
        if self.hang:
            await asyncio.sleep(3600)
        if self.error is not None:
            raise self.error
        return self.answer

    def remote(self, *_args):
        return self._run()


class FakeRuntime:
    def __init__(self, chunks=(), fail_after=None, stats=None, end_session=None):
        self.chunks, self.fail_after = list(chunks), fail_after
        self.scheduler = SimpleNamespace(stats=stats or Call({"workers": {}}))
        self._end = end_session or Call()
        self.ended = []

    async def generate(self, request):
        for chunk in self.chunks:
            yield RequestOutput(request.request_id, **chunk)
        if self.fail_after is not None:
            raise self.fail_after

    async def end_session(self, session_id):
        self.ended.append(session_id)
        return await self._end.remote()


def server(runtime, **settings) -> object:
    return edge_server(runtime, **settings)


def run(coro):
    return asyncio.run(coro)


REQUEST = SimpleNamespace(headers={})


# 500 -> 503: the runtime failing underneath a request that already started -----------------

@pytest.mark.parametrize("failure", [
    NoWorkers("the request failed on 3 workers in a row"),  # the continuation found none
    remote_error(ValueError("cannot resume: prompt and streamed output no longer fit")),
    RayActorError(),
])
def test_a_non_streamed_request_cut_off_mid_way_is_a_503(failure):
    runtime = FakeRuntime(chunks=[{"text": "Hel", "token_ids": [1]}], fail_after=failure)
    with pytest.raises(APIError) as err:
        run(SERVER._complete(server(runtime), chat()))
    assert err.value.status == 503 and err.value.code == "worker_died"
    assert "retry" in err.value.message and err.value.headers["Retry-After"]


def test_a_continuation_refused_in_a_validation_retry_is_a_503_too():
    runtime = FakeRuntime(chunks=[{"text": "{", "token_ids": [1]}],
                          fail_after=NoWorkers("none left"))
    plan = chat(response_format={"type": "json_object"}, validation="retry")
    with pytest.raises(APIError) as err:
        run(SERVER._complete(server(runtime), plan))
    assert err.value.status == 503


# 500 -> 503: the scheduler down, or hanging ----------------------------------------------

@pytest.mark.parametrize("stats", [Call(error=RayActorError()), Call(hang=True)],
                         ids=["down", "hanging"])
def test_models_while_the_scheduler_is_down_is_a_503_within_the_timeout(stats):
    inst = server(FakeRuntime(stats=stats), scheduler_timeout_s=0.2)
    inst._models = []  # nothing cached: the list must come from the scheduler
    with pytest.raises(APIError) as err:
        run(asyncio.wait_for(SERVER.models(inst, REQUEST), 5))
    assert err.value.status == 503 and err.value.code == "unavailable"
    with pytest.raises(APIError) as err:  # a chat request checks its model the same way
        run(asyncio.wait_for(SERVER._check_model(inst, "m"), 5))
    assert err.value.status == 503


@pytest.mark.parametrize("end", [Call(error=RayActorError()), Call(hang=True)],
                         ids=["down", "hanging"])
def test_ending_a_session_while_the_scheduler_is_down_is_a_503(end):
    inst = server(FakeRuntime(end_session=end), scheduler_timeout_s=0.2)
    with pytest.raises(APIError) as err:
        run(asyncio.wait_for(SERVER.end_session(inst, "s1", REQUEST), 5))
    assert err.value.status == 503 and err.value.headers["Retry-After"]


def test_ending_a_session_answers_when_the_scheduler_does():
    runtime = FakeRuntime(end_session=Call(answer=True))
    body = run(SERVER.end_session(server(runtime), "conv-1", REQUEST))
    # the runtime's name for it is the client's (openai_api.session_key)
    assert body["deleted"] is True and runtime.ended == [
        api.session_key(api.client_identity(None, None, None), "conv-1")]


# chat templates ---------------------------------------------------------------------------

def test_a_chat_template_that_refuses_the_messages_is_a_400_naming_messages():
    refusal = jinja2.TemplateError("Conversation roles must alternate user/assistant")
    for exc in (refusal, remote_error(refusal)):
        err = for_exception(exc)
        assert err.status == 400 and err.param == "messages"
        assert "roles must alternate" in err.message
    # the same through the request path: the worker raises before the first chunk
    runtime = FakeRuntime(fail_after=remote_error(refusal))
    with pytest.raises(APIError) as caught:
        run(SERVER._complete(server(runtime), chat()))
    assert caught.value.status == 400 and caught.value.param == "messages"


def test_a_chat_template_that_does_not_parse_stays_the_servers_bug():
    err = for_exception(remote_error(jinja2.TemplateSyntaxError("unexpected '}'", 1)))
    assert err.status == 500


# non-finite logprobs ----------------------------------------------------------------------

def _strict_loads(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


# The floor docs/security.md promises ("reported as `-9999.0`"), written out here rather
# than read off responses.LOGPROB_FLOOR: a changed constant must fail this test
DOCUMENTED_FLOOR = -9999.0


def test_the_documented_floor_is_the_one_tested():
    text = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    said = re.search(r"is reported as `(-?[0-9.]+)`", " ".join(text.split()))
    assert said and float(said.group(1)) == DOCUMENTED_FLOOR, "docs/security.md's floor moved"


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_non_finite_logprobs_are_reported_as_the_floor(kind):
    plan = chat(logprobs=True, top_logprobs=2) if kind == "chat" else completion(
        prompt="a", logprobs=2)
    out = RequestOutput(plan.requests[0].request_id, text="ab", token_ids=[1, 2],
                        finished=True, finish_reason="stop",
                        logprobs=[(math.nan, [(1, -math.inf), (3, -0.5)]), (-math.inf, [])],
                        logprob_tokens=[["a", ["a", "c"]], ["b", []]])
    body = responses.response_body(plan, [out], "m")
    rendered = JSONResponse(body).body  # allow_nan=False: a NaN here was a 500
    # streamed: every event is strict JSON, and carries the same numbers
    sse = responses.StreamAssembler(plan, "m")
    events = sse.start() + sse.feed(0, out) + sse.finish()
    assert events[-1].strip() == "data: [DONE]"
    streamed = [_strict_loads(e.removeprefix("data: ")) for e in events[:-1] if e.strip()]
    seen = [_strict_loads(rendered)["choices"][0]["logprobs"]] + [
        c["logprobs"] for e in streamed for c in e["choices"] if c.get("logprobs")]
    assert len(seen) >= 2, events  # the body's and at least one event's
    for lps in seen:
        if kind == "chat":
            first, second = lps["content"]
            assert first["logprob"] == DOCUMENTED_FLOOR == second["logprob"]
            assert [a["logprob"] for a in first["top_logprobs"]] == [DOCUMENTED_FLOOR, -0.5]
        else:
            assert lps["token_logprobs"] == [DOCUMENTED_FLOOR] * 2
            assert lps["top_logprobs"][0] == {"a": DOCUMENTED_FLOOR, "c": -0.5}


# limits on request state ------------------------------------------------------------------

@pytest.mark.parametrize("sid", ["x" * 129, "", "caf\u00e9", "a b", "a/b", "\ud800",
                                 "s\n1", "\u0663\u0663"])
def test_bad_session_ids_are_a_400_naming_the_field(sid):
    for plan in (lambda: chat(session_id=sid),
                 lambda: completion(prompt="a", session_id=sid)):
        with pytest.raises(APIError) as err:
            plan()
        assert err.value.status == 400 and err.value.param == "session_id"
    with pytest.raises(APIError) as err:  # DELETE /v1/sessions/{id} checks it the same way
        run(SERVER.end_session(server(FakeRuntime()), sid, REQUEST))
    assert err.value.status == 400 and err.value.param == "session_id"


@pytest.mark.parametrize("sid", ["x" * 128, "conv-1", "user@example.com:42",
                                 "0b8f1c2e-6d7a-4e0f-9a55-2f3c9d1e7b60"])
def test_ordinary_session_ids_pass(sid):
    assert chat(session_id=sid).requests[0].session_id == sid


def test_the_session_id_limit_is_a_setting():
    with pytest.raises(APIError):
        chat(limits=Limits(max_session_id_chars=8), session_id="123456789")


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", "b"], "n": 9}, "n"),
    ({"prompt": ["a"] * 17}, "prompt"),
    ({"prompt": "a", "n": 17}, "n"),
])
def test_completion_choices_are_bounded(body, param):
    with pytest.raises(APIError) as err:
        completion(**body)
    assert err.value.status == 400 and err.value.param == param
    assert len(completion(prompt=["a", "b"], n=8).requests) == 16  # at the limit: fine


def _tool(**fn):
    return {"type": "function", "function": {"name": "f", **fn}}


@pytest.mark.parametrize("tool", [
    _tool(description="d" * 300),
    _tool(parameters={"type": "object", "properties": {"x": {"type": "string",
                                                             "description": "d" * 300}}}),
])
def test_tool_definitions_count_toward_the_prompt_limit(tool):
    limits = Limits(max_prompt_chars=400)
    chat(limits=limits, tools=[_tool()])  # a small tool fits
    with pytest.raises(APIError) as err:
        chat(limits=limits, tools=[tool])
    assert err.value.status == 413 and err.value.param == "tools"
    assert "tool definitions" in err.value.message
    # with tool_choice none the tools are not in the prompt
    chat(limits=limits, tools=[tool], tool_choice="none")


def test_a_completion_prompt_over_the_limit_names_prompt():
    with pytest.raises(APIError) as err:
        completion(limits=Limits(max_prompt_chars=10), prompt="x" * 11)
    assert err.value.status == 413 and err.value.param == "prompt"


# self-healing -----------------------------------------------------------------------------

def test_healing_a_scheduler_redeploys_in_place(monkeypatch):
    """A rebuilt scheduler replaces the front ends by a rolling redeploy (new
    runtime_generation), never by deleting the app (Serve's proxy answered 404 then)."""
    from cluster import launch
    from deploy import service as svc

    deployed, deleted = [], []
    monkeypatch.setattr(svc, "missing_components", lambda s: [launch.SCHEDULER_NAME])
    monkeypatch.setattr(svc.launch, "up", lambda config: {"cache": 1, "scheduler": 2,
                                                          "workers": []})
    monkeypatch.setattr(svc.serve, "delete", lambda name: deleted.append(name))
    monkeypatch.setattr(svc, "_deploy", lambda args: deployed.append(dict(args)))
    service = svc.Service("http://x", False, True, runtime=None, config=None,
                          app_args={"api_key": None, "start_runtime": False})
    assert svc.heal(service, progress=None) == [launch.SCHEDULER_NAME]
    svc.heal(service, progress=None)
    assert deleted == []
    assert [d["runtime_generation"] for d in deployed] == [1, 2]
    # the app takes the argument (unknown ones are refused)
    assert AppSettings.from_args(deployed[-1]).runtime_generation == 2


def test_a_temporary_session_end_never_holds_the_answer():
    """n > 1 runs in a session the server ends after the answer is assembled; a scheduler
    that hangs then must not hold the answer past scheduler_timeout_s."""
    runtime = FakeRuntime(chunks=[{"text": "a", "token_ids": [1], "finished": True,
                                   "finish_reason": "stop"}], end_session=Call(hang=True))
    plan = chat(n=2)
    body = run(asyncio.wait_for(
        SERVER._complete(server(runtime, scheduler_timeout_s=0.2), plan), 5))
    assert len(body["choices"]) == 2 and runtime.ended == [plan.temp_session]
