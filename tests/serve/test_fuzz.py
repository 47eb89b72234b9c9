"""Hostile input against the real stack (Ray Serve + FastAPI + scheduler + a worker with a
tiny random-weight model and the real tokenizer, real xgrammar): generated request bodies
of every shape must never get a status >= 500, and afterwards the server is healthy and
nothing is left on the worker.

Two fuzzers: a hypothesis strategy over request bodies (types, nesting, sizes, unicode,
mixed dialects, tools, sessions, raw non-JSON bytes), and schemathesis over the app's own
OpenAPI schema. Beside them, hostile categories a type-and-size fuzzer does not reach:
integers of thousands of digits, lone surrogates and invalid UTF-8 inside JSON strings,
schema keywords with wrong-typed values, ``$ref`` to URLs and files, huge repetition counts,
unicode session ids. A local listener stands in for "the network": the schemas point at it,
and it must never see a connection (nor may a file's content come back).
``RAYGUIDE_FUZZ_EXAMPLES`` scales every count (``make fuzz`` runs 10x); the statuses seen,
per category, are printed at the end.
"""

import collections
import json
import os
import socket
import threading
import time
import urllib.parse

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.config import ClusterConfig
from cluster.launch import free_port
from deploy import service

pytestmark = pytest.mark.integration

KEY = "fuzz-key"
EXAMPLES = int(os.environ.get("RAYGUIDE_FUZZ_EXAMPLES", "120"))
SEEN: dict[int, int] = {}  # status -> count, printed at the end
BY_CATEGORY: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
# schemas name the local listener as http://LISTENER/...; the port is put in when sent
LISTENER = "LISTENER"


@pytest.fixture(scope="module")
def svc(tiny_model_dir, shared_ray):
    config = ClusterConfig(model=str(tiny_model_dir), num_workers=1,
                           worker={"num_cpus": 1, "num_threads": 1},
                           engine={"num_kv_blocks": 128, "max_model_len": 256},
                           scheduler={"load_poll_interval_s": 0.3})
    with shared_ray():  # cleared also when the start fails
        yield service.start(config, port=free_port(), api_key=KEY,
                            app_args={"max_body_bytes": 200_000, "default_max_tokens": 8})


class Listener:
    """A local TCP listener standing in for every address a schema names: it records each
    connection (and answers a tiny JSON schema, so a fetch would not hang but succeed)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.seen: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.seen.append(conn.recv(2048))
                    body = b'{"type": "string"}'
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                except OSError:
                    self.seen.append(b"(no request read)")

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def listener():
    server = Listener()
    yield server
    server.close()


def post(svc, path, headers=None, category="generated", timeout=120, **kw):
    r = httpx.post(svc.url + path, headers={"Authorization": f"Bearer {KEY}", **(headers or {})},
                   timeout=timeout, **kw)
    SEEN[r.status_code] = SEEN.get(r.status_code, 0) + 1
    BY_CATEGORY[category][r.status_code] += 1
    return r


def with_listener(payload, listener):
    at = f"127.0.0.1:{listener.port}"
    if isinstance(payload, bytes):
        return payload.replace(LISTENER.encode(), at.encode())
    return payload.replace(LISTENER, at)


def assert_refused_or_served(r, context):
    """Never a 5xx; a refusal is a JSON error that says something; nothing of a local file
    comes back."""
    assert r.status_code < 500, (r.status_code, r.text[:500], context)
    assert "root:" not in r.text, (r.text[:500], context)  # /etc/passwd's first line
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"], err


# strategies ---------------------------------------------------------------------------

text = st.text(max_size=40)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), text)
anything = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)), max_leaves=12)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
REF_TARGETS = [f"http://{LISTENER}/x.json", f"http://{LISTENER}/x.json#/definitions/a",
               "file:///etc/passwd", "file:///etc/passwd#/a", f"//{LISTENER}/x.json",
               "x.json"]  # the last two resolve against a remote $id
ref_schemas = st.builds(
    lambda target, place: place(target), st.sampled_from(REF_TARGETS), st.sampled_from([
        lambda t: {"$ref": t},
        lambda t: {"type": "object", "not": {"$ref": t}},
        lambda t: {"type": "object", "properties": {"a": {"$ref": t}}},
        lambda t: {"type": "object", "allOf": [{"$ref": t}]},
        lambda t: {"$id": f"http://{LISTENER}/root.json", "type": "object",
                   "anyOf": [{"$ref": t}, {"type": "object"}]},
        lambda t: {"$schema": t, "type": "object"},
        lambda t: {"type": "object", "$defs": {"a": {"$dynamicRef": t}},
                   "properties": {"a": {"$ref": "#/$defs/a"}}},
    ]))
WRONG_TYPED = {  # keyword -> (the type it applies to, wrong values)
    "multipleOf": ("integer", ["x", 0, -1, None, [], {}, True, 1e-320]),
    "minimum": ("number", ["a", None, [], {"x": 1}]),
    "maximum": ("number", ["a", True, []]),
    "exclusiveMinimum": ("number", ["a", True]),
    "minItems": ("array", [-1, "3", 1.5, 10**30, None]),
    "maxItems": ("array", [-1, "3", 2.5, 10**30]),
    "minLength": ("string", [-1, "1", 0.5, 10**20]),
    "maxLength": ("string", [-5, "9", [], 2**64]),
    "pattern": ("string", [5, None, [], {}, "(", "[", "a**", "\\"]),
    "format": ("string", [5, "no-such-format", []]),
    "required": ("object", ["a", 5, [1], [None], {}]),
    "properties": ("object", [[], "a", 5, {"a": 5}, {"a": "string"}]),
    "additionalProperties": ("object", ["no", 5, []]),
    "items": ("array", [3, "x", [5]]),
    "enum": ("string", [5, "a", {}, []]),
    "type": (None, [5, "strin", ["string", 5], [], {}]),
    "minProperties": ("object", [-1, "2"]),
    "uniqueItems": ("array", ["yes", 5]),
    "const": (None, [float("1e308")]),
}
wrong_typed_schemas = st.sampled_from(sorted(WRONG_TYPED)).flatmap(
    lambda kw: st.sampled_from(WRONG_TYPED[kw][1]).map(
        lambda v, kw=kw: ({"type": WRONG_TYPED[kw][0]} if WRONG_TYPED[kw][0] else {}) | {kw: v}))
schemas = st.one_of(st.just(SCHEMA), st.just({"type": "string", "maxLength": 5}), anything,
                    st.just({"type": "array", "minItems": 3, "maxItems": 1}),
                    ref_schemas, wrong_typed_schemas)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool",
                                                    "developer"]),
                           "content": st.one_of(text, st.none(), anything)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none(),
                           "tool_calls": anything}),
    anything)
tool = st.one_of(
    st.builds(lambda name, params: {"type": "function", "function": {
        "name": name, "parameters": params}},
        st.from_regex(r"[a-z_]{1,8}", fullmatch=True), schemas),
    anything)
field_values = {
    "messages": st.lists(message, max_size=3),
    "prompt": st.one_of(text, st.lists(st.integers(-5, 60000), max_size=5), anything),
    "max_tokens": st.one_of(st.integers(1, 6), st.sampled_from([0, -1, 9000, 10**9]),
                            anything),
    "temperature": st.one_of(st.sampled_from([0, 1e-40, 1.0, 2.0, -1, 1e9]), anything),
    "n": st.one_of(st.integers(-1, 3), anything),
    "stop": st.one_of(text, st.lists(text, max_size=20), anything),
    "stream": st.booleans(),
    "session_id": st.one_of(st.sampled_from(["s1", "s2"]), text, anything),
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
            {"name": st.just("x"), "schema": schemas})}),
        st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text", "regex_schema",
                                                        "xml"])}),
        st.fixed_dictionaries({"type": st.just("regex_schema"),
                               "regex_schema": st.sampled_from(["[a-z]{3}", "(", "a*", ""])}),
        anything),
    "guided_regex": st.one_of(st.sampled_from(["[0-9]{2}", "((", "x|y"]), anything),
    "guided_choice": st.one_of(st.lists(text, max_size=3), anything),
    "guided_json": st.one_of(schemas, text),
    "guided_grammar": st.one_of(st.sampled_from(['root ::= "a"', "root ::=", "x"]), anything),
    "structured_outputs": anything,
    "tools": st.lists(tool, max_size=3),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), anything),
    "logprobs": anything,
    "top_logprobs": anything,
    "stop_token_ids": anything,
    "seed": anything,
    "validation": st.one_of(st.sampled_from(["flag", "retry", "off"]), anything),
    "stream_options": anything,
    "unknown_field": anything,
}
bodies = st.dictionaries(st.sampled_from(sorted(field_values)), st.none(), max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries({k: field_values[k] for k in keys}))


def _nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


raw_bodies = st.one_of(
    st.binary(max_size=64), st.sampled_from([b"", b"null", b"[]", b'"x"', b"{", _nested(100),
                                             _nested(100_000), b'{"messages": NaN}']))


# the fuzzers --------------------------------------------------------------------------

@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(body=bodies, route=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_generated_bodies_never_get_a_5xx(svc, listener, body, route):
    if "messages" in body and route == "/v1/completions":
        body.setdefault("prompt", "hi")
    try:
        payload = json.dumps(body)
    except (TypeError, ValueError):
        return
    r = post(svc, route, content=with_listener(payload, listener))
    assert_refused_or_served(r, payload[:500])


@settings(max_examples=max(20, EXAMPLES // 4), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(raw=raw_bodies)
def test_raw_bodies_never_get_a_5xx(svc, raw):
    r = post(svc, "/v1/chat/completions", content=raw, category="raw bodies",
             headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:300])


# hostile categories ------------------------------------------------------------------
# Each builds a whole body around one hostile part; the part goes where a client can put
# it: the request's own numbers, a guided_json given as text, tool-call arguments, ...

CHAT = "/v1/chat/completions"
USER = {"role": "user", "content": "hi"}


def _tool_call_turn(arguments: str) -> list:
    return [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


# where a huge integer literal can sit: (route, body text with NUM for the digits)
BIG_INT_PLACES = [
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": NUM}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -NUM}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "n": NUM}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "seed": NUM}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "temperature": NUM}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "temperature": 0.NUM}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": NUM, '
           '"logprobs": true}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [NUM]}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": NUM}}'),
    (CHAT, '{"messages": [{"role": "user", "content": NUM}]}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "guided_json": '
           '"{\\"type\\": \\"integer\\", \\"maximum\\": NUM}"}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "guided_json": '
           '{"type": "integer", "minimum": NUM}}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "guided_json": '
           '{"type": "array", "maxItems": NUM}}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "guided_json": '
           '{"type": "integer", "multipleOf": 1.NUM}}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "guided_json": '
           '{"type": "integer", "enum": [NUM]}}'),
    (CHAT, '{"messages": ' + json.dumps(_tool_call_turn('{"a": NUM}')) + '}'),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
           '"function": {"name": "f", "parameters": {"type": "object", "properties": {"a": '
           '{"type": "integer", "maximum": NUM}}}}}]}'),
    ("/v1/completions", '{"prompt": [NUM], "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": NUM}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "n": NUM}'),
]


@settings(max_examples=max(10, EXAMPLES // 6), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(digits=st.integers(4_000, 20_000), place=st.sampled_from(BIG_INT_PLACES),
       lead=st.sampled_from("123456789"))
def test_integers_of_thousands_of_digits(svc, digits, place, lead):
    route, template = place
    payload = template.replace("NUM", lead + "1" * (digits - 1))
    r = post(svc, route, content=payload, category="huge integers",
             headers={"Content-Type": "application/json"})
    assert_refused_or_served(r, (route, template))


# text that is not Unicode, inside a JSON string: an escaped lone surrogate is valid JSON
# (Python decodes it to a str that cannot be encoded); raw invalid bytes are not UTF-8
BAD_TEXT = [b"\\ud800", b"\\udfff", b"\\udc00\\ud800", b"a\\ud83d", b"\\ud83d\\u0041",
            b"\xff", b"\xfe\xff", b"\xc3", b"\xc3(", b"\xed\xa0\x80", b"\xc0\xaf",
            b"\xf4\x90\x80\x80", b"\x80\x80", b"ok\xe2\x82"]
# (route, body with BAD where the bad text goes, inside a JSON string)
BAD_TEXT_PLACES = [
    (CHAT, b'{"messages": [{"role": "user", "content": "BAD"}], "max_tokens": 2}'),
    (CHAT, b'{"messages": [{"role": "system", "content": "BAD"}, '
           b'{"role": "user", "content": "hi"}], "max_tokens": 2}'),
    (CHAT, b'{"messages": [{"role": "BAD", "content": "hi"}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "BAD"}]}], '
           b'"max_tokens": 2}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["BAD"], '
           b'"max_tokens": 2}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "session_id": "BAD"}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "model": "BAD"}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "guided_regex": "aBAD"}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "guided_choice": ["BAD", "b"]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "guided_grammar": '
           b'"root ::= \\"BAD\\""}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "guided_json": {"type": '
           b'"object", "properties": {"BAD": {"type": "string"}}, "required": ["BAD"]}, '
           b'"max_tokens": 8}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "guided_json": {"enum": '
           b'["BAD"]}, "max_tokens": 8}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "guided_json": {"type": '
           b'"string", "pattern": "^BAD$"}}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "guided_json": '
           b'"{\\"const\\": \\"BAD\\"}"}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
           b'"function", "function": {"name": "f", "description": "BAD", "parameters": '
           b'{"type": "object"}}}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
           b'"function", "function": {"name": "BAD", "parameters": {"type": "object"}}}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
           b'"content": null, "tool_calls": [{"id": "c", "type": "function", "function": '
           b'{"name": "f", "arguments": "{\\"a\\": \\"BAD\\"}"}}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "BAD": 1}'),
    ("/v1/completions", b'{"prompt": "BAD", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": ["hi", "BAD"], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "response_format": {"type": '
                        b'"regex_schema", "regex_schema": "BAD"}}'),
]


@settings(max_examples=max(20, EXAMPLES // 4), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(place=st.sampled_from(BAD_TEXT_PLACES), bad=st.sampled_from(BAD_TEXT),
       around=st.sampled_from([(b"", b""), (b"x", b"y"), (b"\xc3\xa9", b"\xf0\x9f\x99\x82")]))
def test_lone_surrogates_and_invalid_utf8_in_json_strings(svc, place, bad, around):
    route, template = place
    payload = template.replace(b"BAD", around[0] + bad + around[1])
    r = post(svc, route, content=payload, category="bad text in strings",
             headers={"Content-Type": "application/json"})
    assert_refused_or_served(r, payload[:300])


# where a client's schema goes
SCHEMA_PLACES = [
    lambda sc: {"guided_json": sc},
    lambda sc: {"guided_json": json.dumps(sc)},
    lambda sc: {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": sc}}},
    lambda sc: {"response_format": {"type": "json_schema", "json_schema": {"schema": sc}}},
    lambda sc: {"tools": [{"type": "function", "function": {"name": "f", "parameters": sc}}],
                "tool_choice": "required"},
    lambda sc: {"structured_outputs": {"json": sc}},
]


@settings(max_examples=max(20, EXAMPLES // 4), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(schema=wrong_typed_schemas, place=st.sampled_from(SCHEMA_PLACES),
       validation=st.sampled_from(["flag", "retry", "off"]))
def test_schema_keywords_with_wrong_typed_values(svc, schema, place, validation):
    body = {"messages": [USER], "max_tokens": 8, "validation": validation, **place(schema)}
    r = post(svc, CHAT, json=body, category="wrong-typed keywords")
    assert_refused_or_served(r, body)


@settings(max_examples=max(20, EXAMPLES // 4), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(schema=ref_schemas, place=st.sampled_from(SCHEMA_PLACES),
       validation=st.sampled_from(["flag", "retry"]))
def test_refs_to_urls_and_files_are_never_followed(svc, listener, schema, place, validation):
    body = {"messages": [USER], "max_tokens": 16, "validation": validation, **place(schema)}
    r = post(svc, CHAT, content=with_listener(json.dumps(body), listener),
             category="$ref to URLs and files", headers={"Content-Type": "application/json"})
    assert_refused_or_served(r, body)
    assert not listener.seen, (body, listener.seen[:3])


# huge repetition counts: compiled (or refused) fast, never a hang or a 5xx
REPEAT = ["a{100000}", "(ab){100000}", "[0-9]{1,100000}", "a{99999,100000}", "(a{1000}){1000}",
          "x{100000,}", "(a|b){0,100000}c", "a{4294967296}", "a{1,99999999999999999999}"]
REPEAT_PLACES = [
    lambda r: {"guided_regex": r},
    lambda r: {"response_format": {"type": "regex_schema", "regex_schema": r}},
    lambda r: {"structured_outputs": {"regex": r}},
    lambda r: {"guided_json": {"type": "string", "pattern": f"^{r}$"}},
    lambda r: {"guided_json": {"type": "object", "properties": {"a": {
        "type": "string", "pattern": r}}, "required": ["a"]}},
    lambda r: {"guided_grammar": f'root ::= "a"{r[r.index("{"):r.index("}") + 1]}'},
    lambda r: {"guided_json": {"type": "array", "items": {"type": "integer"},
                               "minItems": 100000}},
    lambda r: {"guided_json": {"type": "string", "minLength": 100000, "maxLength": 100000}},
]


@settings(max_examples=max(15, EXAMPLES // 6), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(regex=st.sampled_from(REPEAT), place=st.sampled_from(REPEAT_PLACES),
       suffix=st.integers(0, 10**6))
def test_huge_repetition_counts(svc, regex, place, suffix):
    # a distinct count each time (a cache hit would hide a slow compile)
    regex = regex.replace("100000", str(100000 + suffix))
    body = {"messages": [USER], "max_tokens": 4, **place(regex)}
    started = time.monotonic()
    r = post(svc, CHAT, json=body, category="huge repetition counts", timeout=90)
    took = time.monotonic() - started
    assert_refused_or_served(r, body)
    assert took < 60, (took, body)  # a refusal, or a fast answer; never a hang


session_ids = st.one_of(
    st.text(min_size=1, max_size=40),
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40),
    st.sampled_from(["séance", "セッション", "🙂🙂", "a\u0000b", "a/b", "../x", "a%2Fb", " ",
                     "\u202eevil", "e\u0301", "\ufeffs", "s\n", "x" * 10_000, "%", "?a=b",
                     "#", "ß", "\U0010ffff"]))


@settings(max_examples=max(15, EXAMPLES // 6), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(sid=session_ids, route=st.sampled_from([CHAT, "/v1/completions", "DELETE"]))
def test_unicode_session_ids(svc, sid, route):
    if route == "DELETE":
        r = httpx.delete(svc.url + "/v1/sessions/" + urllib.parse.quote(sid.encode("utf-8", "surrogatepass"), safe=""),
                         headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        SEEN[r.status_code] = SEEN.get(r.status_code, 0) + 1
        BY_CATEGORY["unicode session ids"][r.status_code] += 1
    else:
        body = {"session_id": sid, "max_tokens": 2,
                **({"messages": [USER]} if route == CHAT else {"prompt": "hi"})}
        r = post(svc, route, json=body, category="unicode session ids")
    assert_refused_or_served(r, sid[:80])


def test_no_outbound_connection_was_made(listener):
    """Every test above sent schemas naming the listener; none may have reached it."""
    assert not listener.seen, listener.seen[:5]


def test_schemathesis_against_the_openapi_schema(svc):
    import schemathesis

    auth = {"Authorization": f"Bearer {KEY}"}
    schema = httpx.get(svc.url + "/openapi.json", headers=auth, timeout=30).json()
    loaded = schemathesis.openapi.from_dict(schema)
    loaded.config.update(base_url=svc.url, headers=auth)
    failures = []
    for operation in loaded.get_all_operations():
        op = operation.ok()
        strategy = op.as_strategy()

        @settings(max_examples=max(10, EXAMPLES // 6), deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def run(case):
            response = case.call(base_url=svc.url, headers=auth, timeout=120)
            SEEN[response.status_code] = SEEN.get(response.status_code, 0) + 1
            BY_CATEGORY["schemathesis"][response.status_code] += 1
            if response.status_code >= 500:
                failures.append((op.label, response.status_code, response.text[:300]))

        run()
    assert not failures, failures[:5]


def test_afterwards_healthy_and_nothing_left(svc):
    r = httpx.get(svc.url + "/health", timeout=30)
    assert r.status_code == 200, r.text
    from cluster import launch
    deadline = time.monotonic() + 60
    while True:
        loads = launch.status()["workers"]
        left = [(w["running"], w["waiting"], w["live_processors"], w["waiting_for_grammar"])
                for w in loads]
        if all(v == (0, 0, 0, 0) for v in left) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(v == (0, 0, 0, 0) for v in left), left
    print(f"\nfuzz: {sum(SEEN.values())} responses by status: {dict(sorted(SEEN.items()))}")
    for category, statuses in sorted(BY_CATEGORY.items()):
        print(f"fuzz: {category}: {sum(statuses.values())} requests, "
              f"statuses {dict(sorted(statuses.items()))}")
