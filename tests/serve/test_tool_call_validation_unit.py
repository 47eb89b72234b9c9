"""Tool-call arguments are validated against their function's ``parameters`` like any JSON
answer, and the verdict is reported per call in the choice's ``guided`` report (it was
null for every call: the grammar only approximates some keywords, and a call closed at
the budget can lack required arguments)."""

import json

import pytest

from core.request import RequestOutput
from deploy import openai_api as api
from deploy import responses, tools
from deploy.settings import Limits

pytestmark = pytest.mark.unit

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 2},
                                     "days": {"type": "integer", "maximum": 14}},
    "required": ["city"]}}}
NOTE = {"type": "function", "function": {"name": "note"}}  # no parameters: any object


def plan(tool_choice="auto", stream=False):
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": [WEATHER, NOTE], "tool_choice": tool_choice, "stream": stream}
    return api.plan_chat(api.parse_request(api.ChatCompletionRequest, body), Limits(),
                         api.Served(None, {}))


def call(name, arguments):
    return tools.call_text(name, arguments)


def finished(p, text, reason="stop"):
    return RequestOutput(p.requests[0].request_id, text, finished=True, finish_reason=reason,
                         grammar_engine="xgrammar")


def test_each_call_is_validated_and_reported():
    p = plan("required")
    text = "\n".join([call("get_weather", {"city": "Oslo", "days": 3}),
                      call("get_weather", {"days": 40}),  # no city, days over the maximum
                      call("note", {"text": "hi"})])
    (choice,) = responses.response_body(p, [finished(p, text)], "m")["choices"]
    calls, guided = choice["message"]["tool_calls"], choice["guided"]
    assert [v["id"] for v in guided["tool_calls"]] == [c["id"] for c in calls]
    assert [v["validation"] for v in guided["tool_calls"]] == ["valid", "invalid", "valid"]
    assert "city" in guided["tool_calls"][1]["validation_error"]
    assert guided["tool_calls"][0]["validation_error"] is None
    assert guided["validation"] == "invalid"
    assert guided["validation_error"].startswith("tool call get_weather: ")


def test_valid_calls_make_a_valid_choice():
    p = plan()
    text = call("get_weather", {"city": "Oslo"})
    guided = responses.response_body(p, [finished(p, text)], "m")["choices"][0]["guided"]
    assert guided["validation"] == "valid" and guided["validation_error"] is None
    assert [v["name"] for v in guided["tool_calls"]] == ["get_weather"]


def test_text_under_auto_has_no_calls_to_validate():
    p = plan("auto")
    guided = responses.response_body(p, [finished(p, "It is cold.")], "m")["choices"][0][
        "guided"]
    assert guided["tool_calls"] == [] and guided["validation"] is None


def test_required_call_cut_off_by_the_budget_is_invalid():
    p = plan("required")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    guided = responses.response_body(p, [finished(p, text, "length")], "m")["choices"][0][
        "guided"]
    assert guided["validation"] == "invalid" and "no complete tool call" in guided[
        "validation_error"]


def test_a_call_to_a_function_not_in_tools_is_invalid():
    report = tools.call_report(tools.parse_tool_calls(call("delete_all", {}))[1],
                               tools.tool_grammar([WEATHER], "auto", None)[0], "auto")
    assert report["validation"] == "invalid"
    assert "no function named 'delete_all'" in report["tool_calls"][0]["validation_error"]


def test_streamed_calls_are_reported_with_the_finish():
    p = plan("required", stream=True)
    sse = responses.StreamAssembler(p, "m")
    rid = p.requests[0].request_id
    events = sse.start()
    events += sse.feed(0, RequestOutput(rid, call("get_weather", {"city": "O"})[:20]))
    events += sse.feed(0, RequestOutput(rid, call("get_weather", {"city": "O"})[20:],
                                        finished=True, finish_reason="stop"))
    last = [json.loads(e[6:]) for e in events][-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    (verdict,) = last["guided"]["tool_calls"]
    assert verdict["id"] == last["delta"]["tool_calls"][0]["id"]
    assert verdict["validation"] == "invalid" and verdict["validation_error"].startswith("at /city")
    assert last["guided"]["validation"] == "invalid"
