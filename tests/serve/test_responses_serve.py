"""POST /v1/responses end to end (issue 61, part 2): Ray Serve in front of the runtime (the
tiny model: what is checked is the route, the grammar and the events, not the answers),
driven by the real ``openai`` client: ``responses.create``, ``responses.parse`` with a
pydantic model, the client's stream helper for text and for a function call, a
conversation continued with ``previous_response_id`` (and a function call answered in it),
and the refusals."""

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from cluster.config import ClusterConfig
from cluster.launch import free_port
from deploy import service

pytestmark = pytest.mark.integration

KEY = "responses-key"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"enum": ["Oslo", "Bergen", "Lima"]}}, "required": ["city"],
               "additionalProperties": False}, "strict": True}


class Sky(BaseModel):
    color: Literal["blue", "grey", "black"]
    cloudy: bool


@pytest.fixture(scope="module")
def client(tiny_model_dir, shared_ray):
    config = ClusterConfig(model=str(tiny_model_dir), num_workers=1,
                           worker={"num_cpus": 1, "num_threads": 1},
                           engine={"num_kv_blocks": 256},
                           scheduler={"load_poll_interval_s": 0.3})
    with shared_ray():
        # two replicas: a conversation's turns reach either (the proxy picks), and each
        # finds what the other stored (the grammar cache actor's store)
        svc = service.start(config, port=free_port(), api_key=KEY, num_replicas=2)
        yield openai.OpenAI(base_url=svc.url + "/v1", api_key=KEY, max_retries=0,
                            timeout=120)


def test_create_parse_and_usage(client):
    r = client.responses.create(model=None, input="Say hi.", max_output_tokens=8,
                                temperature=0.5, extra_body={"seed": 3})
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete") and isinstance(r.output_text, str)
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    again = client.responses.create(model=None, input="Say hi.", max_output_tokens=8,
                                    temperature=0.5, extra_body={"seed": 3})
    assert again.output_text == r.output_text  # seeded

    parsed = client.responses.parse(model=None, input="Describe the sky.",
                                    instructions="Answer in JSON.", text_format=Sky,
                                    max_output_tokens=64)
    assert isinstance(parsed.output_parsed, Sky)
    assert parsed.model_extra["guided"]["validation"] == "valid"
    assert parsed.text.format.type == "json_schema"

    obj = client.responses.create(model=None, input="Any JSON.", max_output_tokens=32,
                                  text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.output_text), dict)


def test_streamed_text_in_the_clients_stream_helper(client):
    deltas, kinds = [], []
    with client.responses.stream(model=None, input="Describe the sky.", text_format=Sky,
                                 max_output_tokens=64) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.done" in kinds
    assert isinstance(final.output_parsed, Sky) and "".join(deltas) == final.output_text
    assert final.usage.output_tokens > 0


def test_streamed_function_call(client):
    kinds, args = [], ""
    for event in client.responses.create(model=None, input="Weather in Oslo?",
                                         tools=[WEATHER], tool_choice="required",
                                         parallel_tool_calls=False,
                                         max_output_tokens=64, stream=True):
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            args += event.delta
        if event.type == "response.completed":
            final = event.response
    assert "response.function_call_arguments.done" in kinds and json.loads(args)["city"]
    call = final.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert final.model_extra["guided"]["tool_calls"][0]["id"] == call.call_id


def test_a_conversation_goes_on_and_a_call_is_answered(client):
    first = client.responses.create(model=None, input="Weather in Lima?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=64)
    call = next(o for o in first.output if o.type == "function_call")
    assert json.loads(call.arguments)["city"] in ("Oslo", "Bergen", "Lima")
    second = client.responses.create(  # tools are the request's own: sent again
        model=None, previous_response_id=first.id, max_output_tokens=8, tools=[WEATHER],
        tool_choice="auto", input=[{"type": "function_call_output", "call_id": call.call_id,
                                    "output": "21 C and sunny"}])
    assert second.previous_response_id == first.id
    # the whole conversation was sent again, the call and its output on top of the first,
    # and the first's prompt came from the prefix cache
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 64
    third = client.responses.create(model=None, previous_response_id=second.id,
                                    input="Thanks.", max_output_tokens=4, store=False,
                                    tools=[WEATHER])
    assert third.usage.input_tokens > second.usage.input_tokens
    with pytest.raises(openai.NotFoundError) as err:  # store: false kept nothing
        client.responses.create(model=None, previous_response_id=third.id, input="x")
    assert third.id in str(err.value)


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"background": True}, "background"),
    ({"extra_body": {"bogus": 1}}, "bogus"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "https://x/y.png"}]}]},
     "input.0.content.0.type"),
])
def test_refusals_name_the_field(client, kw, param):
    kw.setdefault("input", "hi")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=None, **kw)
    assert err.value.body["param"] == param
