"""POST /v1/responses without Ray (issue 61, part 2): a Responses request becomes the chat
plan it means (deploy/responses_api.py), errors name the Responses field, the Response
object and its event stream (deploy/responses_events.py) are what the ``openai`` package's
own types and stream accumulator read, and conversations (deploy/response_store.py) are
bounded, expire, and are their tenant's alone, through the server's request path with a
fake runtime."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai._models import construct_type
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel

from core.errors import ErrorKind
from core.request import RequestOutput
from deploy import openai_api as api
from deploy import responses_api as rapi
from deploy import responses_events as events
from deploy.errors import APIError
from core.response_store import ResponseStore
from deploy.settings import Limits
from deploy.tenants import read_keys_file
from tests.serve.fakes import SERVER, edge_server

pytestmark = pytest.mark.unit

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather",
           "parameters": SCHEMA}


def turn(context=None, history=None, **body):
    body.setdefault("input", "hi")
    return rapi.plan_response(api.parse_request(rapi.ResponsesRequest, body), history,
                              Limits(), api.Served(context))


def refused(**body) -> APIError:
    with pytest.raises(APIError) as err:
        turn(**body)
    assert err.value.status == 400, err.value.message
    return err.value


def output(t, text, reason="stop", **kw):
    return RequestOutput(t.plan.requests[0].request_id, text=text, token_ids=[1] * 3,
                         finished=True, finish_reason=reason, prompt_tokens=7,
                         completion_tokens=3, cached_tokens=4, **kw)


# --- translation -------------------------------------------------------------------------

def test_input_items_become_the_chat_messages_they_mean():
    t = turn(instructions="Be brief.", input=[
        {"role": "developer", "content": "Use metric units."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in "},
                     {"type": "input_text", "text": "Oslo?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "12 C"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "12 C.",
                                           "annotations": []}]},
        {"role": "user", "content": "And Bergen?"}])
    prompt = t.plan.requests[0].prompt
    assert [m["role"] for m in prompt] == ["system", "system", "user", "assistant", "user",
                                           "assistant", "user"]
    assert prompt[0]["content"] == "Be brief." and prompt[2]["content"] == "Weather in Oslo?"
    assert '"name": "get_weather"' in prompt[3]["content"]  # the call, as the tools write it
    assert "<tool_response>\n12 C\n</tool_response>" == prompt[4]["content"]
    # the turn keeps what it added to the conversation, never the instructions
    assert t.history == [] and t.messages[0] == {"role": "developer",
                                                  "content": "Use metric units."}
    assert t.messages[2]["tool_calls"][0]["id"] == "call_1"


def test_a_conversation_goes_on_from_its_history():
    history = [{"role": "user", "content": "Hi, I am Ada."},
               {"role": "assistant", "content": "Hello Ada."}]
    t = turn(history=history, input="What is my name?", instructions="Answer in French.")
    assert [m["content"] for m in t.plan.requests[0].prompt] == [
        "Answer in French.", "Hi, I am Ada.", "Hello Ada.", "What is my name?"]


def test_text_format_tools_and_budget_use_the_chat_machinery():
    t = turn(text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA,
                              "strict": True}}, max_output_tokens=33, temperature=0.3,
             top_p=0.8, seed=5)
    p = t.plan.requests[0].params
    assert t.plan.grammar.kind == "json_schema" and t.plan.grammar.strict
    assert (p.max_new_tokens, p.temperature, p.top_p, p.seed) == (33, 0.3, 0.8, 5)
    assert turn(text={"format": {"type": "json_object"}}).plan.grammar is not None
    assert turn(text={"format": {"type": "text"}}).plan.grammar is None
    t = turn(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert t.plan.tool_mode == "named" and t.plan.tools[0]["name"] == "get_weather"
    assert "get_weather" in t.plan.requests[0].prompt[0]["content"]  # described to the model
    assert turn(tools=[WEATHER], tool_choice="required").plan.tool_mode == "required"
    assert turn(tools=[WEATHER], tool_choice="none").plan.tool_mode is None


@pytest.mark.parametrize("body, param", [
    ({"bogus": 1}, "bogus"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
    ({"tools": [{**WEATHER, "cache": True}]}, "tools.0.cache"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"type": "object",
                                     "properties": {"a": {"$ref": "http://x/s.json"}}}}}},
     "text.format.schema"),
    ({"tools": [WEATHER], "text": {"format": {"type": "json_object"}}}, "tools"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"seed": -1}, "seed"),
])
def test_refusals_name_the_responses_field(body, param):
    err = refused(**body)
    assert err.param == param, (err.param, err.message)
    assert "response_format" not in err.message and "max_tokens" not in err.message


def test_a_budget_over_the_context_names_max_output_tokens():
    with pytest.raises(APIError) as err:
        turn(context=100, max_output_tokens=500)
    assert err.value.param == "max_output_tokens"
    assert err.value.message.startswith("max_output_tokens is 500")


def test_a_template_error_in_an_item_names_the_item():
    err = refused(input=[{"role": "user", "content": "x"},
                         {"role": "user", "content": {"not": "text"}}])
    assert err.param == "input.1.content"


# --- the Response object and its stream ----------------------------------------------------

def test_the_body_is_a_response_the_client_reads():
    t = turn(text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}})
    body = events.response_body(t, output(t, '{"city": "Oslo"}', validation="valid",
                                          grammar_engine="llguidance"), "m")
    r = Response.model_validate(body)
    assert r.output_text == '{"city": "Oslo"}' and r.status == "completed"
    assert r.usage.input_tokens == 7 and r.usage.output_tokens == 3
    assert r.usage.input_tokens_details.cached_tokens == 4 and r.usage.total_tokens == 10
    assert body["guided"]["validation"] == "valid" and body["guided"]["engine"] == "llguidance"
    assert body["id"] == t.id and body["text"]["format"]["name"] == "w"


def test_the_budget_ends_a_response_incomplete():
    t = turn()
    body = events.response_body(t, output(t, "cut", "length"), "m")
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"


def test_tool_calls_are_function_call_items_with_their_verdicts():
    t = turn(tools=[WEATHER], tool_choice="required")
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"town": 1}}\n</tool_call>')
    body = events.response_body(t, output(t, text), "m")
    calls = [i for i in body["output"] if i["type"] == "function_call"]
    assert [i["type"] for i in body["output"]] == ["function_call"] * 2  # no empty message
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    verdicts = body["guided"]["tool_calls"]
    assert [v["id"] for v in verdicts] == [c["call_id"] for c in calls]
    assert [v["validation"] for v in verdicts] == ["valid", "invalid"]
    Response.model_validate(body)
    # the conversation keeps the calls, so a function_call_output can answer them
    kept = events.conversation(t, body)
    assert kept[-1]["tool_calls"][0]["id"] == calls[0]["call_id"]


def replay(stream, chunks, text_format=None, tools=None):
    """Feeds ``chunks`` through ``stream`` and reads the events as the openai package's
    stream helper does; returns (event types, the helper's final response, the raw
    events)."""
    raw = stream.start()
    for chunk in chunks:
        raw += stream.feed(0, chunk)
    raw += stream.finish()
    state = ResponseStreamState(input_tools=tools or [],
                                text_format=text_format if text_format else omit)
    kinds, seqs, parsed = [], [], []
    for sse in raw:
        kind, data = sse.split("\n", 1)
        payload = json.loads(data[len("data: "):])
        assert kind == f"event: {payload['type']}"
        event = construct_type(type_=ResponseStreamEvent, value=payload)
        kinds.append(payload["type"])
        seqs.append(payload["sequence_number"])
        parsed += state.handle_event(event)
    assert seqs == list(range(len(seqs)))
    final = next((e.response for e in parsed if e.type == "response.completed"), None)
    return kinds, final, raw


def chunks_of(t, parts, reason="stop", **last):
    rid = t.plan.requests[0].request_id
    out = [RequestOutput(rid, text=p, token_ids=[1]) for p in parts[:-1]]
    return out + [RequestOutput(rid, text=parts[-1], token_ids=[1], finished=True,
                                finish_reason=reason, prompt_tokens=5,
                                completion_tokens=len(parts), **last)]


class City(BaseModel):
    city: str


def test_a_streamed_text_reads_in_the_clients_stream_helper():
    t = turn(stream=True, text={"format": {"type": "json_schema", "name": "City",
                                           "schema": SCHEMA, "strict": True}})
    stream = events.ResponseStream(t, "m")
    kinds, final, _ = replay(stream, chunks_of(t, ['{"city"', ': "Os', 'lo"}'],
                                               validation="valid"), City)
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert final.output_parsed == City(city="Oslo")
    assert final.usage.output_tokens == 3 and final.model_extra["guided"]["validation"] == "valid"
    assert stream.final["output"][0]["content"][0]["text"] == '{"city": "Oslo"}'


def test_a_streamed_function_call_reads_in_the_clients_stream_helper():
    t = turn(stream=True, tools=[WEATHER], tool_choice="auto")
    parts = ["\n", "<tool_", 'call>\n{"name": "get_weather", "arguments": ',
             '{"city": "Oslo"}}\n</tool_call>']
    kinds, final, _ = replay(events.ResponseStream(t, "m"), chunks_of(t, parts))
    assert "response.output_text.delta" not in kinds  # whitespace before a call is no text
    assert kinds[2:] == ["response.output_item.added",
                         "response.function_call_arguments.delta",
                         "response.function_call_arguments.done",
                         "response.output_item.done", "response.completed"]
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Oslo"} and call.call_id.startswith("call_")


def test_a_stream_cut_by_the_budget_ends_incomplete():
    t = turn(stream=True)
    kinds, final, raw = replay(events.ResponseStream(t, "m"),
                               chunks_of(t, ["a", "b"], "length"))
    assert kinds[-1] == "response.incomplete" and final is None
    last = json.loads(raw[-1].split("data: ", 1)[1])
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_stream_that_fails_after_it_started_says_so():
    t = turn(stream=True)
    rid = t.plan.requests[0].request_id
    stream = events.ResponseStream(t, "m")
    stream.start()
    stream.feed(0, RequestOutput(rid, text="par", token_ids=[1]))
    stream.feed(0, RequestOutput(rid, finished=True, finish_reason="error",
                                 error="the worker died", error_kind=ErrorKind.WORKER_DIED))
    last = json.loads(stream.finish()[-1].split("data: ", 1)[1])
    assert last["type"] == "response.failed" and stream.final is None
    assert last["response"]["error"]["code"] == "worker_died"


def test_a_reasoning_models_thought_is_its_own_item():
    t = turn(stream=True)
    rid = t.plan.requests[0].request_id
    chunks = [RequestOutput(rid, reasoning="hmm", token_ids=[1], reasoning_tokens=1),
              RequestOutput(rid, text="42", token_ids=[1], finished=True,
                            finish_reason="stop", reasoning_tokens=1, completion_tokens=2)]
    kinds, final, _ = replay(events.ResponseStream(t, "m"), chunks)
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output_text == "42" and "response.reasoning_text.delta" in kinds


# --- the store, and the route ----------------------------------------------------------------

def test_the_store_is_bounded_expires_and_keeps_tenants_apart():
    now = [0.0]
    store = ResponseStore(ttl_s=10, max_entries=3, max_chars=10_000, clock=lambda: now[0])
    msgs = [{"role": "user", "content": "x"}]
    store.put("a", "r1", msgs)
    assert store.get("a", "r1") == msgs and store.get("b", "r1") is None
    now[0] = 11
    assert store.get("a", "r1") is None and len(store) == 0  # expired
    for i in range(3):
        store.put("heavy", f"h{i}", [{"role": "user", "content": "y" * 100}])
    store.put("light", "l0", msgs)  # full: the heaviest tenant's oldest goes
    assert store.get("heavy", "h0") is None and store.get("light", "l0") == msgs
    assert store.get("heavy", "h2") is not None and store.evicted == 1
    assert not store.put("a", "big", [{"role": "user", "content": "z" * 20_000}])


class EchoRuntime:
    """Answers each request with the last user message it was sent, upper-cased; its
    ``shared`` store stands for the grammar cache actor's (RuntimeClient's
    remember_response / stored_response: the same ResponseStore, without Ray)."""

    def __init__(self, shared: ResponseStore | None = None):
        self.prompts = []
        self.shared = ResponseStore(3600, 100, 1_000_000) if shared is None else shared

    async def remember_response(self, owner, response_id, messages, ttl_s=None):
        return self.shared.put(owner, response_id, messages, ttl_s)

    async def stored_response(self, owner, response_id):
        return self.shared.get(owner, response_id)

    async def generate(self, request):
        self.prompts.append(request.prompt)
        text = request.prompt[-1]["content"].upper()
        yield RequestOutput(request.request_id, text=text, token_ids=[1], finished=True,
                            finish_reason="stop", prompt_tokens=3, completion_tokens=1)


def request(body, key=None):
    raw = json.dumps(body).encode()

    async def stream():
        yield raw
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return SimpleNamespace(headers=headers, client=SimpleNamespace(host="10.0.0.1"),
                           url=SimpleNamespace(path="/v1/responses"), stream=stream,
                           query_params={})


def create(srv, key=None, **body):
    return asyncio.run(SERVER.create_response(srv, request(body, key)))


def test_previous_response_id_continues_the_tenants_conversation(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("acme: acme-key-1234\nglobex: globex-key-1234\n")
    srv = edge_server(EchoRuntime(), tenant_keys=read_keys_file(str(keys)))
    first = create(srv, "acme-key-1234", input="hello", instructions="Shout.")
    assert first["output"][0]["content"][0]["text"] == "HELLO"
    second = create(srv, "acme-key-1234", input="again", previous_response_id=first["id"])
    assert [m["content"] for m in srv.runtime.prompts[-1]] == ["hello", "HELLO", "again"]
    assert second["previous_response_id"] == first["id"]
    with pytest.raises(APIError) as err:  # another tenant never reads it
        create(srv, "globex-key-1234", input="x", previous_response_id=second["id"])
    assert err.value.status == 404 and err.value.param == "previous_response_id"
    assert second["id"] in err.value.message and err.value.code == "response_not_found"
    unstored = create(srv, "acme-key-1234", input="secret", store=False)
    with pytest.raises(APIError) as err:
        create(srv, "acme-key-1234", input="x", previous_response_id=unstored["id"])
    assert err.value.status == 404
    with pytest.raises(APIError) as err:
        create(srv, "acme-key-1234", input="x", previous_response_id="resp_nope")
    assert err.value.status == 400 and err.value.param == "previous_response_id"


def test_a_conversation_goes_on_on_another_replica(tmp_path):
    """Two replicas (front ends) of one runtime: a response stored by one is continued on
    the other (the shared store: the grammar cache actor's), streamed or not, and still
    per tenant; a replica's own store alone would answer 404."""
    keys = tmp_path / "keys.txt"
    keys.write_text("acme: acme-key-1234\nglobex: globex-key-1234\n")
    shared = ResponseStore(3600, 100, 1_000_000)
    one, two = (edge_server(EchoRuntime(shared), tenant_keys=read_keys_file(str(keys)))
                for _ in range(2))
    first = create(one, "acme-key-1234", input="hello")
    assert two._stored.get("tacme", first["id"]) is None  # not in the other's own store
    second = create(two, "acme-key-1234", input="again", previous_response_id=first["id"])
    assert [m["content"] for m in two.runtime.prompts[-1]] == ["hello", "HELLO", "again"]

    async def streamed():
        response = await SERVER.create_response(two, request(
            {"input": "more", "stream": True, "previous_response_id": second["id"]},
            "acme-key-1234"))
        events = [e async for e in response.body_iterator]
        done = json.loads(next(e for e in events if "response.completed" in e)
                          .split("data: ", 1)[1])
        return done["response"]["id"]
    third = asyncio.run(streamed())
    create(one, "acme-key-1234", input="last", previous_response_id=third)
    assert [m["content"] for m in one.runtime.prompts[-1]] == [
        "hello", "HELLO", "again", "AGAIN", "more", "MORE", "last"]
    with pytest.raises(APIError) as err:  # another tenant, on either replica
        create(one, "globex-key-1234", input="x", previous_response_id=third)
    assert err.value.status == 404 and err.value.code == "response_not_found"


@pytest.mark.parametrize("body", [
    {"input": [1]}, {"input": [{"type": ["message"]}]},
    {"input": [{"role": "user", "content": [{"type": {"x": 1}}]}]},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
    {"input": [{"type": "function_call", "name": 3}]},
    {"input": [{"type": "function_call_output", "call_id": "c", "output": {"x": 1}}]},
    {"text": {"format": "json"}}, {"text": {"format": {"type": ["json_schema"]}}},
    {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "extra": 1}}},
    {"text": {"verbosity": "high"}}, {"text": {"fmt": {}}},
    {"tools": ["get_weather"]}, {"tools": [{"type": "function", "name": "f",
                                            "parameters": "not a schema"}]},
    {"tool_choice": {"type": "function", "name": 7}}, {"tool_choice": 3},
    {"input": "x" * 300_000},
])
def test_hostile_shapes_are_4xx_never_a_crash(body):
    with pytest.raises(APIError) as err:
        turn(**body)
    assert 400 <= err.value.status < 500


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False)
    | st.text(max_size=12) | st.sampled_from(["function", "message", "json_schema", "text",
                                             "input_text", "user", "required", "auto"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "name", "role", "content", "text", "schema", "format",
                         "parameters", "call_id", "arguments", "output", "x"]),
        inner, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(st.sampled_from(sorted(rapi.ResponsesRequest.model_fields)),
                            _json, max_size=6))
def test_generated_bodies_are_planned_or_refused(body):
    """Any body: a Turn whose answer assembles, or an APIError (4xx), nothing else."""
    body.setdefault("input", "hi")
    try:
        t = rapi.plan_response(api.parse_request(rapi.ResponsesRequest, body), None,
                               Limits(), api.Served(4096))
    except APIError as err:
        assert 400 <= err.status < 500
        return
    Response.model_validate(events.response_body(t, output(t, "{}"), "m"))


def test_metadata_is_echoed_within_openais_bounds():
    assert turn(metadata={"job": "nightly"}).echo["metadata"] == {"job": "nightly"}
    assert refused(metadata={"n": 1}).param == "metadata.n"
    assert refused(metadata={f"k{i}": "v" for i in range(17)}).param == "metadata"
