"""The edge's rules without Ray: the one error table, limits named in 4xx answers, hostile
shapes that once gave 500s, dialect depth limits, tool-call collapsing, SSE assembly."""

import json

import pytest

from core.errors import ErrorKind
from core.request import RequestOutput
from deploy import dialects, openai_api as api, responses, tools
from deploy.errors import STATUS, APIError, for_exception, for_kind
from deploy.settings import AppSettings, Limits

pytestmark = pytest.mark.unit

LIMITS = Limits()


def chat(limits=LIMITS, context=None, sampling=None, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return api.plan_chat(api.parse_request(api.ChatCompletionRequest, body), limits,
                         api.Served(context, sampling or {}))


def test_every_kind_has_one_status():
    assert set(STATUS) == set(ErrorKind)
    for kind, (status, _) in STATUS.items():
        if kind.client_fault:
            assert 400 <= status < 500, kind
        elif kind.transient:
            assert status in (429, 503), kind
        else:
            assert status == 500, kind


def test_transient_failures_say_retry_and_carry_a_hint():
    err = for_kind(ErrorKind.GRAMMAR_UNAVAILABLE, "the compile process crashed")
    assert err.status == 503 and "retry" in err.message and err.headers["Retry-After"]
    # a kind read off the wire as a string maps the same way
    assert for_kind("worker_died", "gone").status == 503
    assert for_kind(None, "no kind").status == 500  # unknown kinds are bugs, never 4xx


def test_a_refusal_that_knows_its_wait_says_it_in_retry_after():
    import pickle

    from core.errors import GrammarUnavailable
    refused = pickle.loads(pickle.dumps(  # as it crosses Ray from the worker
        GrammarUnavailable("share spent", ErrorKind.OVERLOADED, retry_after_s=7.2)))
    err = for_exception(refused)
    assert err.status == 429 and err.headers["Retry-After"] == "8"
    assert for_exception(GrammarUnavailable("full", ErrorKind.OVERLOADED)).headers == {
        "Retry-After": "1"}


def test_exceptions_map_by_type_never_by_text():
    from core.errors import GrammarError, GrammarUnavailable, NoWorkers, Overloaded
    assert for_exception(Overloaded("busy")).status == 429
    assert for_exception(NoWorkers("none")).status == 503
    assert for_exception(GrammarUnavailable("over the limit")).status == 503
    assert for_exception(GrammarError("x", ErrorKind.COMPILE_TIMEOUT)).status == 422
    assert for_exception(ValueError("prompt is empty")).status == 400
    from ray.exceptions import GetTimeoutError, RayActorError
    assert for_exception(RayActorError()).status == 503  # the runtime failed underneath
    assert for_exception(GetTimeoutError("slow")).status == 503
    assert for_exception(RuntimeError("actor died")).status == 500  # our own bug


@pytest.mark.parametrize("body, param", [
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": ["x" * 257]}, "stop"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"messages": [{"role": "user", "content": "a"}] * 1025}, "messages"),
    ({"n": 17}, "n"),
    ({"max_tokens": 9000}, "max_tokens"),  # over the context below
])
def test_limits_are_named(body, param):
    with pytest.raises(APIError) as err:
        chat(context=8192, **body)
    assert err.value.status == 400 and err.value.param == param


def test_prompt_characters_checked_before_tokenization():
    with pytest.raises(APIError) as err:
        chat(limits=Limits(max_prompt_chars=100),
             messages=[{"role": "user", "content": "x" * 101}])
    assert err.value.status == 413


def test_model_sampling_defaults_fill_what_the_request_leaves_unset():
    p = chat(sampling={"temperature": 0.2, "top_p": 0.9}).requests[0].params
    assert (p.temperature, p.top_p) == (0.2, 0.9)
    p = chat(sampling={"temperature": 0.2, "top_p": 0.9}, temperature=1.0).requests[0].params
    assert (p.temperature, p.top_p) == (1.0, 0.9)


def test_generation_defaults_from_the_model_dir(tmp_path):
    from worker.models.gguf_convert import DEFAULT_MODEL_SAMPLING, write_sampling_defaults
    from worker.models.loader import generation_defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "eos_token_id": 2}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert generation_defaults(tmp_path) == {}
    # the default model's conversion writes its card's values; a config that sets its own
    # sampling is left alone
    assert write_sampling_defaults(tmp_path, DEFAULT_MODEL_SAMPLING)
    assert generation_defaults(tmp_path) == DEFAULT_MODEL_SAMPLING
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 2
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    assert not write_sampling_defaults(tmp_path, DEFAULT_MODEL_SAMPLING)
    assert generation_defaults(tmp_path) == {"temperature": 0.7}


def test_default_budget_stays_within_the_context():
    assert chat(context=100).requests[0].params.max_new_tokens == 99


@pytest.mark.parametrize("tool_calls", [
    [{"function": "x"}], 5, [5], [{"function": {"name": 3}}], "calls",
    [{"function": {"name": "f", "arguments": "{oops"}}],
])
def test_bad_tool_call_history_is_a_400(tool_calls):
    with pytest.raises(APIError) as err:
        chat(messages=[{"role": "assistant", "content": "", "tool_calls": tool_calls}])
    assert err.value.status == 400 and "tool_calls" in err.value.param


@pytest.mark.parametrize("tools_", [[5], ["x"], [{"type": "function", "function": 3}]])
def test_bad_tools_are_a_400(tools_):
    with pytest.raises(APIError) as err:
        chat(tools=tools_)
    assert err.value.status == 400


def test_deep_schemas_are_refused_before_anything_recurses():
    deep = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(APIError) as err:
        chat(guided_json=deep)
    assert err.value.status == 413 and err.value.param == "guided_json"
    with pytest.raises(dialects.DialectError):
        dialects.from_batch_line({"schema": deep}, None)


def test_grammar_size_counts_bytes():
    with pytest.raises(APIError) as err:
        chat(guided_regex="é" * 140_000)  # 140k characters, 280k bytes
    assert err.value.status == 413 and err.value.code == "grammar_too_large"


def test_identical_tool_calls_collapse():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    _, calls = tools.parse_tool_calls(call + "\n" + call + "\n" + other)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Oslo", "Rome"]


def test_settings_take_strings_and_flat_limits():
    s = AppSettings.from_args({"max_n": "4", "num_replicas": "2", "start_runtime": "false"})
    assert s.limits.max_n == 4 and s.num_replicas == 2 and s.start_runtime is False
    with pytest.raises(ValueError, match="max_nn"):
        AppSettings.from_args({"max_nn": 4})


def _events(lines):
    return [json.loads(e[len("data: "):]) for e in lines if e != "data: [DONE]\n\n"]


def test_stream_assembler_orders_role_content_finish_usage():
    plan = chat(n=1, stream=True, stream_options={"include_usage": True},
                guided_regex="[a-z]+")
    rid = plan.requests[0].request_id
    sse = responses.StreamAssembler(plan, "m")
    out = sse.start()
    out += sse.feed(0, RequestOutput(rid, "ab", [1, 2]))
    out += sse.feed(0, RequestOutput(rid, "c", [3], finished=True, finish_reason="stop",
                                     prompt_tokens=5, completion_tokens=3))
    out += sse.finish()
    events = _events(out)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:3]) == "abc"
    assert events[2]["choices"][0]["finish_reason"] == "stop"
    assert "guided" in events[2]["choices"][0]
    assert events[3]["usage"]["completion_tokens"] == 3 and out[-1] == "data: [DONE]\n\n"


def test_stream_assembler_reports_a_mid_stream_error_with_its_status():
    plan = chat(stream=True)
    rid = plan.requests[0].request_id
    sse = responses.StreamAssembler(plan, "m")
    out = sse.feed(0, RequestOutput(rid, "a", [1]))
    out += sse.feed(0, RequestOutput(rid, finished=True, finish_reason="error",
                                     error="worker w0 died", error_kind=ErrorKind.WORKER_DIED))
    err = _events(out)[-1]["error"]
    assert err["code"] == "worker_died" and "retry" in err["message"]
