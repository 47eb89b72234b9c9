"""The edge's side of reasoning models without Ray or HTTP: the budget fields, and the
thought as reasoning_content (message, streamed deltas) and reasoning_tokens in usage."""

import json

import pytest

from core.request import RequestOutput
from deploy import openai_api as api
from deploy import responses
from deploy.errors import APIError
from deploy.settings import Limits

pytestmark = pytest.mark.unit


def chat(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return api.plan_chat(api.parse_request(api.ChatCompletionRequest, body), Limits())


def test_budget_fields():
    assert chat().requests[0].thinking_token_budget is None
    assert chat(thinking_token_budget=24).requests[0].thinking_token_budget == 24
    assert chat(thinking_budget=7, n=2).requests[1].thinking_token_budget == 7  # SGLang's
    assert chat(thinking_budget=5, thinking_token_budget=5).requests[0] \
        .thinking_token_budget == 5
    with pytest.raises(APIError, match="differ") as err:
        chat(thinking_budget=5, thinking_token_budget=6)
    assert err.value.status == 400 and err.value.param == "thinking_token_budget"
    with pytest.raises(APIError, match=">= 0") as err:
        chat(thinking_budget=-1)
    assert err.value.param == "thinking_budget"
    with pytest.raises(APIError) as err:
        chat(thinking_token_budget="many")
    assert err.value.status == 400 and err.value.param == "thinking_token_budget"
    comp = api.plan_completion(api.parse_request(
        api.CompletionRequest, {"prompt": "x", "thinking_token_budget": 3}), Limits())
    assert comp.requests[0].thinking_token_budget == 3


def test_an_echoed_thought_is_dropped():
    plan = chat(messages=[{"role": "user", "content": "a"},
                          {"role": "assistant", "content": "b", "reasoning_content": "c"},
                          {"role": "user", "content": "d"}])
    assert plan.requests[0].prompt[1] == {"role": "assistant", "content": "b"}


def outputs(plan, reasoning_tokens):
    out = RequestOutput(plan.requests[0].request_id, text='{"a": 1}', reasoning="hmm",
                        finished=True, finish_reason="stop", prompt_tokens=4,
                        completion_tokens=9, reasoning_tokens=reasoning_tokens)
    return [out]


def test_message_and_usage():
    plan = chat()
    body = responses.response_body(plan, outputs(plan, 5), "m")
    assert body["choices"][0]["message"]["reasoning_content"] == "hmm"
    assert body["choices"][0]["message"]["content"] == '{"a": 1}'
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
    plain = responses.response_body(plan, outputs(plan, None), "m")  # no reasoning model
    assert "reasoning_content" not in plain["choices"][0]["message"]
    assert "completion_tokens_details" not in plain["usage"]


def test_streamed_deltas():
    plan = chat(stream=True, stream_options={"include_usage": True})
    rid = plan.requests[0].request_id
    asm = responses.StreamAssembler(plan, "m")
    events = asm.start()
    events += asm.feed(0, RequestOutput(rid, reasoning="Let me "))
    events += asm.feed(0, RequestOutput(rid, reasoning="see."))
    events += asm.feed(0, RequestOutput(rid, text="ok", finished=True, finish_reason="stop",
                                        completion_tokens=6, reasoning_tokens=4))
    events += asm.finish()
    data = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    deltas = [d["choices"][0]["delta"] for d in data if d["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me see."
    assert "".join(d.get("content", "") for d in deltas) == "ok"
    assert data[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
