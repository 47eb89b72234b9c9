"""The OpenAI request rules without Ray or HTTP: field checks, every guided dialect mapping
to one grammar, tool grammars (compiled by the real xgrammar), tool-call parsing, streaming
hold-back, usage."""

import json

import pytest

from core.request import RequestOutput
from deploy import openai_api as api
from deploy import responses, tools
from deploy.errors import APIError
from deploy.settings import Limits

pytestmark = pytest.mark.unit

LIMITS = Limits()


def chat(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return api.plan_chat(api.parse_request(api.ChatCompletionRequest, body), LIMITS)


def grammar_of(plan):
    return plan.requests[0].grammar


def test_unknown_field_is_named():
    with pytest.raises(APIError, match="temprature") as err:
        chat(temprature=0.5)
    assert err.value.status == 400 and err.value.param == "temprature"


def test_params_mapping():
    plan = chat(max_completion_tokens=7, temperature=0, top_p=0.9, seed=5, stop="END",
                presence_penalty=0.5, logprobs=True, top_logprobs=3, n=2, top_k=4)
    p0, p1 = (r.params for r in plan.requests)
    assert p0.max_new_tokens == 7 and p0.stop == ("END",) and p0.logprobs == 3
    assert p0.top_k == 4 and p0.temperature == 0
    assert (p0.seed, p1.seed) == (5, 6)  # n samples differ
    # n > 1 without a session: a server-made session, so the samples share a worker
    assert plan.temp_session and {r.session_id for r in plan.requests} == {plan.temp_session}
    assert [r.seq_id for r in plan.requests] == [0, 1]
    assert chat().requests[0].params.max_new_tokens == LIMITS.default_max_tokens
    assert chat().requests[0].session_id is None


@pytest.mark.parametrize("body, bad", [
    ({"n": 0}, "n must be"), ({"n": 17}, "n must be"), ({"max_tokens": 0}, "max_tokens"),
    ({"top_logprobs": 2}, "needs logprobs"), ({"logit_bias": {"1": 2}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "needs stream"),
    ({"messages": []}, "empty"), ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text parts"),
    ({"tool_choice": "required"}, "needs tools"),
])
def test_bad_requests(body, bad):
    with pytest.raises(APIError, match=bad) as err:
        chat(**body)
    assert err.value.status == 400


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("body, kind", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": False}}},
     "json_schema"),
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "regex_schema", "regex_schema": "[a-z]+"}}, "regex"),
    ({"guided_json": SCHEMA}, "json_schema"),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema"),
    ({"guided_regex": "[0-9]+"}, "regex"),
    ({"guided_choice": ["a", "b"]}, "choice"),
    ({"guided_grammar": 'root ::= "x"'}, "ebnf"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema"),
    ({"structured_outputs": {"regex": "x+"}}, "regex"),
    ({"structured_outputs": {"choice": ["p", "q"]}}, "choice"),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "ebnf"),
    ({"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {
        "type": "const_string", "value": "hi"}}}}, "structural_tag"),
])
def test_every_guided_dialect(body, kind):
    g = grammar_of(chat(**body))
    assert g.kind == kind


def test_strict_is_honoured_and_text_is_unguided():
    g = grammar_of(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": False}}))
    assert g.strict is False
    assert grammar_of(chat(response_format={"type": "text"})) is None


def test_one_guided_field_at_most_and_bad_grammars():
    with pytest.raises(APIError, match="only one of"):
        chat(guided_regex="a", guided_choice=["a"])
    with pytest.raises(APIError, match="invalid grammar") as err:
        chat(guided_json="{oops")
    assert err.value.status == 400
    with pytest.raises(APIError) as err:
        chat(guided_regex="a" * 300_000)
    assert err.value.status == 413
    with pytest.raises(APIError, match="response_format"):
        chat(response_format={"type": "xml"})


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOTE = {"type": "function", "function": {"name": "note"}}


@pytest.mark.integration  # the default model's tokenizer
@pytest.mark.parametrize("choice, mode", [
    (None, "auto"), ("auto", "auto"), ("required", "required"),
    ({"type": "function", "function": {"name": "note"}}, "named"), ("none", None)])
def test_tool_modes_compile(choice, mode, default_tokenizer_info):
    plan = chat(tools=[WEATHER, NOTE], tool_choice=choice)
    assert plan.tool_mode == mode
    g = grammar_of(plan)
    if mode is None:
        assert g is None
        return
    system = plan.requests[0].prompt[0]
    assert system["role"] == "system" and "get_weather" in system["content"]
    _check_matches(g, default_tokenizer_info, mode)


def _check_matches(g, info, mode):
    """The real compiler takes the grammar, and a matcher accepts a well-formed call."""
    import xgrammar as xgr

    from grammar_cache.compile import compile_spec
    compiled = compile_spec(xgr.GrammarCompiler(info), g)
    call = '<tool_call>\n{"name": "note", "arguments": {}}\n</tool_call>'
    m = xgr.GrammarMatcher(compiled)
    assert m.accept_string(call)
    assert m.accept_token(info.stop_token_ids[0]) and m.is_terminated()  # it may end here
    if mode != "auto":  # free text is impossible when a call is required
        assert not xgr.GrammarMatcher(compiled).accept_string("Sure! ")


@pytest.fixture(scope="module")
def default_tokenizer_info(default_tokenizer):
    import xgrammar as xgr
    return xgr.TokenizerInfo.from_huggingface(default_tokenizer)


def test_bad_tools():
    with pytest.raises(APIError, match="not in tools"):
        chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(APIError, match="unique"):
        chat(tools=[WEATHER, WEATHER])
    with pytest.raises(APIError, match="name must be"):
        chat(tools=[{"type": "function", "function": {"name": "a b"}}])
    with pytest.raises(APIError, match="cannot be combined"):
        chat(tools=[WEATHER], tool_choice="required", guided_regex="x")


def test_tool_history_is_rendered_as_text():
    plan = chat(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3C"}], tools=[WEATHER])
    msgs = plan.requests[0].prompt
    assert '"name": "get_weather"' in msgs[2]["content"] and "Oslo" in msgs[2]["content"]
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n-3C\n</tool_response>"}


def test_parse_tool_calls():
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "note", "arguments": {}}\n</tool_call>')
    content, calls = tools.parse_tool_calls(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "note"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    content, calls = tools.parse_tool_calls('<tool_call>\n{"name": "x", "argu')  # cut off
    assert calls == [] and content.startswith("<tool_call>")


def test_stream_splitter_holds_back_call_starts():
    s = tools.ToolStreamSplitter()
    out = [s.feed(t) for t in ["Hello <", "b> and <tool", "_call>\n{\"name\": \"note\", ",
                               "\"arguments\": {}}\n</tool_call>"]]
    assert "".join(out) == "Hello <b> and "
    tail, calls = s.finish()
    assert tail == "" and calls[0]["function"]["name"] == "note"
    s = tools.ToolStreamSplitter()
    assert s.feed("a <tool") == "a "
    assert s.finish() == ("<tool", [])  # never a call: the held-back text comes out


def test_completion_plans():
    plan = api.plan_completion(api.parse_request(api.CompletionRequest, {
        "prompt": ["a", "b"], "n": 2, "logprobs": 1, "guided_choice": ["x"]}), LIMITS)
    assert [r.prompt for r in plan.requests] == ["a", "a", "b", "b"]
    assert plan.prompt_index == [0, 0, 1, 1] and plan.logprobs
    assert plan.requests[0].session_id != plan.requests[2].session_id
    assert api.plan_completion(api.parse_request(api.CompletionRequest, {
        "prompt": [1, 2, 3]}), LIMITS).requests[0].prompt == [1, 2, 3]
    with pytest.raises(APIError, match="echo"):
        api.plan_completion(api.parse_request(api.CompletionRequest,
                                              {"prompt": "a", "echo": True}), LIMITS)


def test_usage_counts_each_prompt_once():
    a = RequestOutput("a", prompt_tokens=10, completion_tokens=3, cached_tokens=4)
    b = RequestOutput("b", prompt_tokens=10, completion_tokens=5, cached_tokens=4)
    u = responses.usage([a, b], [0, 0])
    assert u == {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18,
                 "prompt_tokens_details": {"cached_tokens": 4}}


def test_logprob_shapes():
    lps = [(-0.1, [(5, -0.1), (6, -2.0)])]
    toks = [["Hi", ["Hi", "Yo"]]]
    c = responses.chat_logprobs(lps, toks)["content"][0]
    assert c["token"] == "Hi" and c["top_logprobs"][1] == {"token": "Yo", "logprob": -2.0,
                                                           "bytes": [89, 111]}
    lp = responses.completion_logprobs(lps, toks, offset=3)
    assert lp == {"tokens": ["Hi"], "token_logprobs": [-0.1],
                  "top_logprobs": [{"Hi": -0.1, "Yo": -2.0}], "text_offset": [3]}
