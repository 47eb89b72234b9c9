"""Trust (issue 28), at the unit level: a schema never makes the server fetch a URL or read
a file, integers of thousands of digits and JSON nested past the stack are a 400 and never
a 500, and OpenAI's json_schema wrapper without ``name`` enforces the inner schema."""

import http.server
import json
import threading

import pytest

from deploy import openai_api as api
from deploy.errors import APIError
from deploy.settings import AppSettings, Limits
from core.grammar_spec import GrammarSpec
from worker.guided.validation import validate_json

pytestmark = pytest.mark.unit

HUGE = "1" * 5000


@pytest.fixture
def listener():
    """A local HTTP server that records every request it gets."""
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"type": "string"}')

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        server.shutdown()


def test_validation_never_fetches_a_reference(listener, tmp_path):
    url, hits = listener
    secret = tmp_path / "secret.json"
    secret.write_text('{"type": "string", "description": "SECRET"}')
    for ref in (f"{url}/x.json", secret.as_uri()):
        error = validate_json({"type": "object", "not": {"$ref": ref}}, "{}")
        assert error is not None and "SECRET" not in error
    assert hits == []


def test_a_reference_outside_the_schema_is_refused_with_its_name():
    with pytest.raises(ValueError, match=r"\$ref 'http://169.254.169.254/x'.*outside"):
        GrammarSpec.json_schema({"type": "object", "not": {"$ref": "http://169.254.169.254/x"}})
    with pytest.raises(ValueError, match="file:///etc/passwd"):
        GrammarSpec.json_schema({"properties": {"a": {"$ref": "file:///etc/passwd"}}})
    GrammarSpec.json_schema({"$defs": {"a": {"type": "string"}},
                             "properties": {"a": {"$ref": "#/$defs/a"}}})  # local: fine


def chat(**body):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    return api.plan_chat(api.parse_request(api.ChatCompletionRequest, body), Limits())


def test_a_remote_ref_through_the_edge_is_a_400(listener):
    url, hits = listener
    with pytest.raises(APIError) as err:
        chat(guided_json={"type": "object", "not": {"$ref": f"{url}/x.json"}})
    assert err.value.status == 400 and "$ref" in str(err.value)
    assert hits == []


def test_huge_integers_in_a_schema_string_are_a_400():
    with pytest.raises(APIError) as err:
        chat(guided_json='{"type": "integer", "maximum": ' + HUGE + "}")
    assert err.value.status == 400 and "guided_json" in str(err.value)
    with pytest.raises(ValueError, match="json_schema"):
        GrammarSpec.json_schema('{"maximum": ' + HUGE + "}")


def test_huge_integers_in_tool_call_arguments_are_a_400():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": '{"x": ' + HUGE + "}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    with pytest.raises(APIError) as err:
        api.plan_chat(api.parse_request(api.ChatCompletionRequest, {"messages": messages}),
                      Limits())
    assert err.value.status == 400 and "arguments" in str(err.value)


DEEP = "[" * 100_000 + "]" * 100_000  # past Python's stack: json.loads raises RecursionError


def test_json_nested_past_the_stack_is_a_400_naming_its_field():
    import asyncio
    from types import SimpleNamespace

    import deploy.serve_app as serve_app

    with pytest.raises(APIError) as err:  # a schema given as a string
        chat(guided_json='{"type": "object", "default": ' + DEEP + "}")
    assert err.value.status == 400 and err.value.param == "guided_json"
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": '{"x": ' + DEEP + "}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    with pytest.raises(APIError) as err:  # tool-call arguments
        api.plan_chat(api.parse_request(api.ChatCompletionRequest, {"messages": messages}),
                      Limits())
    assert err.value.status == 400 and "tool_calls" in err.value.param
    server = getattr(serve_app.OpenAIServer, "func_or_class", serve_app.OpenAIServer)

    class FakeRequest:
        headers = {}

        async def stream(self):
            yield ('{"messages": ' + DEEP + "}").encode()

    with pytest.raises(APIError) as err:  # the body itself
        asyncio.run(server._body(SimpleNamespace(limits=Limits(), settings=AppSettings()),
                                 FakeRequest()))
    assert err.value.status == 400 and "nested deeper" in str(err.value)


def test_validate_json_reads_a_huge_integer_as_invalid_not_a_crash():
    assert "not valid JSON" in validate_json(None, '{"a": ' + HUGE + "}")


def test_json_schema_wrapper_without_name_enforces_the_inner_schema():
    inner = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    plan = chat(response_format={"type": "json_schema", "json_schema": {"schema": inner}})
    assert json.loads(plan.grammar.source) == inner
    assert json.loads(GrammarSpec.json_schema({"schema": inner}).source) == inner


def test_a_body_with_a_huge_integer_is_a_400():
    import asyncio
    from types import SimpleNamespace

    import deploy.serve_app as serve_app

    server = getattr(serve_app.OpenAIServer, "func_or_class", serve_app.OpenAIServer)
    body = ('{"model": "m", "messages": [], "max_tokens": ' + HUGE + "}").encode()

    class FakeRequest:
        headers = {}

        async def stream(self):
            yield body

    fake = SimpleNamespace(limits=Limits(), settings=AppSettings())
    with pytest.raises(APIError) as err:
        asyncio.run(server._body(fake, FakeRequest()))
    assert err.value.status == 400 and "not valid JSON" in str(err.value)


@pytest.mark.parametrize("raw, says", [
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "lone UTF-16 surrogate"),
    (b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80b"}]}', "not valid JSON"),
])
def test_a_lone_surrogate_in_the_body_is_a_400(raw, says):
    # it reached the tokenizer, which raised a TypeError: a 500 (found by the fuzzer)
    import asyncio
    from types import SimpleNamespace

    import deploy.serve_app as serve_app

    server = getattr(serve_app.OpenAIServer, "func_or_class", serve_app.OpenAIServer)

    class FakeRequest:
        headers = {}

        async def stream(self):
            yield raw

    with pytest.raises(APIError) as err:
        asyncio.run(server._body(SimpleNamespace(limits=Limits(), settings=AppSettings()), FakeRequest()))
    assert err.value.status == 400 and says in str(err.value)
    ok = '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'.encode()
    FakeRequest.stream = lambda self: _once(ok)  # a surrogate pair is one character
    body = asyncio.run(server._body(SimpleNamespace(limits=Limits(), settings=AppSettings()), FakeRequest()))
    assert body["messages"][0]["content"] == "\U0001F600"


async def _once(data):
    yield data


def test_an_aborted_answer_never_says_stop():
    from deploy import responses

    assert responses.finish_reason("abort", False) == "abort"
    assert responses.finish_reason("abort", True) == "abort"  # a cut tool call either
    assert responses.finish_reason("stop", False) == "stop"
    assert responses.finish_reason("length", False) == "length"
