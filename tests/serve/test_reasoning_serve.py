"""A reasoning model served end to end: `rayguide serve --config` with reasoning markers on
the default model, its chat template made a reasoning one (the assistant's turn opens
`<think>\n`, as DeepSeek-R1's does: a request thinks only where its prompt opens the
thought), the real openai client. A json_schema request with thinking_token_budget 24 gets its thought as
reasoning_content (at most 24 tokens), usage's reasoning_tokens, and content that
validates; streamed, the thought comes as reasoning_content deltas before the answer; a
session's second turn (the first answer echoed back with its reasoning_content) and tool
calls after a thought work."""

import json
import subprocess

import jsonschema
import openai
import pytest
import yaml

from cluster.launch import free_port
from tests.serve.test_serve_cli import BIN, env, interrupt, wait_healthy

pytestmark = pytest.mark.integration

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.fixture(scope="module")
def served(default_model_dir, default_tokenizer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning-serve")
    model_dir = tmp / "model"  # the default model's files, its template opening a thought
    model_dir.mkdir()
    for f in default_model_dir.iterdir():
        if f.name != "chat_template.jinja":
            (model_dir / f.name).symlink_to(f)
    template = (default_model_dir / "chat_template.jinja").read_text()
    assert "'<|im_start|>assistant\n'" in template
    (model_dir / "chat_template.jinja").write_text(template.replace(
        "'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'"))
    port = free_port()
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model_dir), "num_workers": 1,
        "engine": {"reasoning": {"start": "<think>", "end": "</think>"},
                   "kv_cache_gb": 0.25}}))
    log = open(tmp / "serve.log", "w+")
    proc = subprocess.Popen(
        [str(BIN / "rayguide"), "serve", "--config", str(config), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=log, text=True, env=env(), start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                               timeout=120)
        yield client, client.models.list().data[0].id, default_tokenizer
    finally:
        assert interrupt(proc) == 0


def test_a_budgeted_thought_then_a_valid_answer(served):
    client, model, tok = served
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person."}],
        response_format=FORMAT, max_tokens=120, temperature=0,
        extra_body={"thinking_token_budget": 24})
    message = r.choices[0].message
    thought = message.model_extra["reasoning_content"]
    assert thought and "</think>" not in thought
    assert len(tok(thought, add_special_tokens=False)["input_ids"]) <= 24
    assert r.usage.completion_tokens_details.reasoning_tokens == 24 + 3  # + '</think>'
    jsonschema.validate(json.loads(message.content), PERSON)
    assert r.choices[0].model_extra["guided"]["validation"] == "valid"


def test_streamed_thought_then_answer_and_a_second_turn(served):
    client, model, _ = served
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person."}],
        response_format=FORMAT, max_tokens=100, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"thinking_budget": 12, "session_id": "reasoning-s1"})
    thought, content, order, usage = "", "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        part = (delta.model_extra or {}).get("reasoning_content")
        if part:
            thought += part
            order.append("r")
        if delta.content:
            content += delta.content
            order.append("c")
    assert thought and content and order.index("c") > max(
        i for i, o in enumerate(order) if o == "r")  # the whole thought comes first
    jsonschema.validate(json.loads(content), PERSON)
    assert usage.completion_tokens_details.reasoning_tokens == 12 + 3
    # the second turn: the first answer echoed back with its thought (dropped, as chat
    # templates drop earlier thoughts)
    r = client.chat.completions.create(
        model=model, response_format=FORMAT, max_tokens=100, temperature=0,
        messages=[{"role": "user", "content": "Describe a person."},
                  {"role": "assistant", "content": content, "reasoning_content": thought},
                  {"role": "user", "content": "Another one."}],
        extra_body={"thinking_token_budget": 8, "session_id": "reasoning-s1"})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.usage.completion_tokens_details.reasoning_tokens == 8 + 3


def test_tool_calls_after_a_thought(served):
    client, model, _ = served
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}}}]
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools, tool_choice="required", max_tokens=100, temperature=0,
        extra_body={"thinking_token_budget": 10})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert "city" in json.loads(call.function.arguments)
    assert r.choices[0].message.model_extra["reasoning_content"]
