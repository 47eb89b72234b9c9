"""Hostile input against the real stack (Ray Serve + FastAPI + scheduler + a worker with a
tiny random-weight model and the real tokenizer, real xgrammar): generated request bodies
of every shape must never get a status >= 500, and afterwards the server is healthy and
nothing is left on the worker.

Two fuzzers: a hypothesis strategy over request bodies (types, nesting, sizes, unicode,
mixed dialects, tools, sessions, raw non-JSON bytes), and schemathesis over the app's own
OpenAPI schema. ``RAYGUIDE_FUZZ_EXAMPLES`` scales both (``make fuzz`` runs a larger count).
"""

import json
import os
import socket
import time

import httpx2 as httpx
import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.config import ClusterConfig
from deploy import service

pytestmark = pytest.mark.integration

KEY = "fuzz-key"
EXAMPLES = int(os.environ.get("RAYGUIDE_FUZZ_EXAMPLES", "120"))
SEEN: dict[int, int] = {}  # status -> count, printed at the end


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def svc(tiny_model_dir):
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="rayguide")
    config = ClusterConfig(model=str(tiny_model_dir), num_workers=1,
                           worker={"num_cpus": 1, "num_threads": 1},
                           engine={"num_kv_blocks": 128, "max_model_len": 256},
                           scheduler={"load_poll_interval_s": 0.3})
    from ray import serve
    try:  # a start that fails must not leave Ray up for the next module
        yield service.start(config, port=free_port(), api_key=KEY,
                            app_args={"max_body_bytes": 200_000, "default_max_tokens": 8})
    finally:
        serve.shutdown()
        ray.shutdown()


def post(svc, path, headers=None, **kw):
    r = httpx.post(svc.url + path, headers={"Authorization": f"Bearer {KEY}", **(headers or {})},
                   timeout=120, **kw)
    SEEN[r.status_code] = SEEN.get(r.status_code, 0) + 1
    return r


# strategies ---------------------------------------------------------------------------

text = st.text(max_size=40)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), text)
anything = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)), max_leaves=12)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
schemas = st.one_of(st.just(SCHEMA), st.just({"type": "string", "maxLength": 5}), anything,
                    st.just({"type": "array", "minItems": 3, "maxItems": 1}))
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
def test_generated_bodies_never_get_a_5xx(svc, body, route):
    if "messages" in body and route == "/v1/completions":
        body.setdefault("prompt", "hi")
    try:
        payload = json.dumps(body)
    except (TypeError, ValueError):
        return
    r = post(svc, route, content=payload)
    assert r.status_code < 500, (r.status_code, r.text[:500], payload[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"]


@settings(max_examples=max(20, EXAMPLES // 4), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(raw=raw_bodies)
def test_raw_bodies_never_get_a_5xx(svc, raw):
    r = post(svc, "/v1/chat/completions", content=raw,
             headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:300])


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
