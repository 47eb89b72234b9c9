"""The OpenAI endpoint end to end: Ray Serve + FastAPI in front of the runtime (scheduler,
one worker with the real default model, the shared grammar cache), driven by the real
``openai`` client and by plain HTTP for what the client cannot send."""

from concurrent.futures import ThreadPoolExecutor
import hashlib
import json
from pathlib import Path
import re
import time

import httpx2 as httpx  # the HTTP client the openai package ships with
import jsonschema
import openai
import pytest
import ray
from pydantic import BaseModel

from cluster import launch
from cluster.config import ClusterConfig
from cluster.launch import free_port
from deploy import service

pytestmark = pytest.mark.integration

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"


# a keys file beside the single KEY (tenant "default"): test_tenants_are_apart
ACME_KEY, GLOBEX_KEY = "acme-key-123", "globex-key-456"


@pytest.fixture(scope="module")
def svc(default_model_dir, shared_ray, tmp_path_factory):
    config = ClusterConfig(num_workers=1, worker={"num_cpus": 1, "num_threads": 1},
                           engine={"num_kv_blocks": 256},
                           scheduler={"load_poll_interval_s": 0.3})
    keys = tmp_path_factory.mktemp("tenants") / "keys.txt"
    digest = hashlib.sha256(GLOBEX_KEY.encode()).hexdigest()
    keys.write_text(f"# tenant: key\nacme: {ACME_KEY}\nglobex: sha256:{digest}\n")
    with shared_ray():
        # two front-end replicas: sessions stay sticky because the scheduler routes them
        yield service.start(config, port=free_port(), api_key=KEY, num_replicas=2,
                            keys_file=str(keys), app_args={"max_body_bytes": 1_000_000})


@pytest.fixture(scope="module")
def client(svc):
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def http(svc, method, path, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, svc.url + path, headers=headers, timeout=120, **kw)


def worker_load():
    w = launch.handles()["workers"][0]
    return ray.get(w.load.remote())


def wait_idle(timeout=20.0):
    """Every request finished and every one-shot session released on the worker."""
    deadline = time.monotonic() + timeout
    while True:
        load = worker_load()
        if (load["running"] == 0 and load["waiting"] == 0 and load["live_processors"] == 0
                and load["live_sessions"] == 0 and load["free_blocks"] == load["total_blocks"]):
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"worker did not release everything: {load}")
        time.sleep(0.2)


def ask(text):
    return [{"role": "user", "content": text}]


def test_health_models_metrics(svc, client):
    assert http(svc, "GET", "/health", key=None).json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == [MODEL]
    text = http(svc, "GET", "/metrics").text
    assert "rayguide_up 1.0" in text and "rayguide_worker_total_blocks" in text
    assert "rayguide_worker_grammar_client_" in text  # the cache client's counters
    # the replica's failover and routing counters (issue 17)
    assert "rayguide_replica_failovers 0.0" in text and "rayguide_replica_own_routes" in text
    # with an API key set, metrics and the API docs follow it; /health tells only ok / not
    for path in ("/metrics", "/openapi.json", "/docs"):
        assert http(svc, "GET", path, key=None).status_code == 401, path
    assert http(svc, "GET", "/openapi.json").json()["paths"]["/v1/chat/completions"]
    assert set(http(svc, "GET", "/health", key=None).json()) == {"status", "workers"}


def test_plain_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("Say hello."),
                                       max_tokens=12, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content.strip()
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5 and 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    wait_idle()


def test_stream_matches_non_stream_and_reports_usage(client):
    kw = dict(model=MODEL, messages=ask("Name three colors."), max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finals and finals[-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


class Planet(BaseModel):
    name: str
    moons: int
    has_rings: bool


def test_parse_pydantic_schema(client):
    r = client.chat.completions.parse(model=MODEL, messages=ask("Describe Saturn."),
                                      response_format=Planet, max_tokens=60, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, Planet)
    jsonschema.validate(json.loads(msg.content), Planet.model_json_schema())


def test_json_object_and_lmdeploy_regex(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("A JSON object about cats."),
                                       response_format={"type": "json_object"},
                                       max_tokens=40, temperature=0)
    # valid whatever ended it: a budget cut closes the object
    assert r.choices[0].finish_reason in ("stop", "length")
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(
        model=MODEL, messages=ask("A date?"), max_tokens=20,
        response_format={"type": "regex_schema", "regex_schema": r"\d{4}-\d{2}-\d{2}"})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.choices[0].message.content)


def test_vllm_guided_fields(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("A phone number?"),
                                       max_tokens=20, extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].message.content)
    r = client.chat.completions.create(model=MODEL, messages=ask("Is fire hot?"), max_tokens=5,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.chat.completions.create(
        model=MODEL, messages=ask("Pick a fruit."), max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["apple", "pear"]}})
    assert r.choices[0].message.content in ("apple", "pear")
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    r = client.chat.completions.create(model=MODEL, messages=ask("Give x."), max_tokens=20,
                                       temperature=0, extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(
        model=MODEL, messages=ask("Answer."), max_tokens=8,
        extra_body={"guided_grammar": 'root ::= "a" | "b"'})
    assert r.choices[0].message.content in ("a", "b")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def check_calls(calls, allowed):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        tool = {t["function"]["name"]: t for t in allowed}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments),
                            tool["function"]["parameters"])


def test_tool_calls(client):
    msgs = ask("What is the weather in Paris?")
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                       tool_choice="required", max_tokens=80, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls, [WEATHER, TIME])
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                       tool_choice=named, max_tokens=80, temperature=0.8,
                                       seed=3)
    calls = r.choices[0].message.tool_calls
    check_calls(calls, [TIME])
    assert len(calls) == 1
    # the call goes back into the conversation as history, with the tool's answer
    follow = msgs + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "10:30"}]
    r = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER, TIME],
                                       max_tokens=30, temperature=0)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    if c.message.tool_calls:
        check_calls(c.message.tool_calls, [WEATHER, TIME])
    else:
        assert c.message.content


def test_tool_calls_streamed(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ask("Weather in Oslo?"), tools=[WEATHER], tool_choice="required",
        max_tokens=80, temperature=0, stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    check_calls([tc for tc in calls], [WEATHER])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_n_samples_and_logprobs(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = client.chat.completions.create(
        model=MODEL, messages=ask("A number."), n=2, max_tokens=20, temperature=1.0, seed=7,
        logprobs=True, top_logprobs=2, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.finish_reason in ("stop", "length")
        jsonschema.validate(json.loads(c.message.content), schema)  # whatever ended it
        lp = c.logprobs.content
        # sampled tokens carry 2 alternatives; forced tokens (jump-forward's `{"n": `, a
        # closing path) none, and logprob 0.0
        assert lp and all(len(t.top_logprobs) in (0, 2) and t.logprob <= 0 for t in lp)
        assert all(t.logprob == 0.0 for t in lp if not t.top_logprobs)
        assert any(len(t.top_logprobs) == 2 for t in lp)  # the number was sampled
        assert "".join(t.token for t in lp).startswith(c.message.content[:3])
    assert r.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in r.choices)
    wait_idle()  # the samples' shared session was ended


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=6, temperature=0, logprobs=2)
    c = r.choices[0]
    assert c.text and len(c.logprobs.tokens) == r.usage.completion_tokens
    assert all(len(d) <= 2 for d in c.logprobs.top_logprobs)
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is",
                                            max_tokens=6, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    r = client.completions.create(model=MODEL, prompt=["One,", "Two,"], max_tokens=3,
                                  extra_body={"guided_choice": ["x", "y"]})
    assert len(r.choices) == 2 and all(ch.text in ("x", "y") for ch in r.choices)


def test_sessions_keep_kv_and_end(svc, client):
    sid = "conv-1"
    msgs = ask("Tell me about tea.")
    r1 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10,
                                        temperature=0, extra_body={"session_id": sid})
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And coffee?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10,
                                        temperature=0, extra_body={"session_id": sid})
    assert r2.usage.prompt_tokens_details.cached_tokens > r1.usage.prompt_tokens // 2
    # the runtime names it after its client (openai_api.session_key)
    assert any(s.endswith(f":{sid}") for s in worker_load()["session_ids"])
    resp = http(svc, "DELETE", f"/v1/sessions/{sid}")
    assert resp.status_code == 200 and resp.json()["deleted"] is True
    wait_idle()


def test_deleting_a_session_aborts_its_running_request(svc):
    """docs/security.md: a request cut short by ``DELETE /v1/sessions/{id}`` finishes with
    ``finish_reason: "abort"``, never ``stop``; docs/reference.md: its KV and grammar
    matchers are freed."""
    sid = "conv-aborted"
    body = {"messages": ask("Write letters."), "max_tokens": 3000, "stream": True,
            "guided_regex": "[a-z]{3000}", "session_id": sid}  # cannot finish on its own
    events, deleted = [], None
    with httpx.stream("POST", svc.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                break
            if line.startswith("data:"):
                events.append(json.loads(line.removeprefix("data:")))
            if deleted is None and len(events) >= 3:
                deleted = http(svc, "DELETE", f"/v1/sessions/{sid}")
                ended_by = time.monotonic() + 30  # the abort, not 3000 tokens later
            assert deleted is None or time.monotonic() < ended_by, "the stream went on"
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    reasons = [c["finish_reason"] for e in events for c in e["choices"]
               if c.get("finish_reason")]
    assert reasons == ["abort"], reasons
    assert len("".join(c["delta"].get("content") or "" for e in events
                       for c in e["choices"])) < 3000
    wait_idle()


def test_tenants_are_apart(svc):
    """Two tenants of the keys file sending the same ``user`` and session id: neither
    continues, probes (cached_tokens) or ends the other's session, nor sees its grammar
    ids (the 404 of an unknown id); one tenant with the same user does; a key not in the
    file is a 401."""
    def chat(key, text, **extra):
        r = http(svc, "POST", "/v1/chat/completions", key=key, json={
            "messages": ask(text), "max_tokens": 4, "temperature": 0, "user": "alice",
            "session_id": "tenant-conv", **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)

    def end(key, sid="tenant-conv"):
        return http(svc, "DELETE", f"/v1/sessions/{sid}", key=key, params={"user": "alice"})

    r = http(svc, "GET", "/v1/models", key="not-in-the-file")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    secret = "The vault code is 4417 and the spare key is under the blue flowerpot."
    chat(ACME_KEY, secret)
    assert chat(ACME_KEY, secret) > 10  # acme, same user: its session's KV
    gone, unknown = end(GLOBEX_KEY), end(GLOBEX_KEY, "never-made")
    assert gone.status_code == unknown.status_code == 404
    assert gone.json()["error"]["code"] == unknown.json()["error"]["code"]
    assert chat(GLOBEX_KEY, secret) == 0  # a session of its own: nothing of acme's
    assert end(GLOBEX_KEY).status_code == 200  # globex's own
    assert chat(ACME_KEY, secret) > 10  # acme's lives on
    assert end(ACME_KEY).status_code == 200
    # grammar ids
    body = {"guided_regex": "[a-z]{3}-tenant", "user": "alice"}
    gid = http(svc, "POST", "/v1/grammars", key=ACME_KEY, json=body).json()["id"]
    assert http(svc, "GET", f"/v1/grammars/{gid}", key=ACME_KEY,
                params={"user": "alice"}).status_code == 200
    theirs = http(svc, "GET", f"/v1/grammars/{gid}", key=GLOBEX_KEY, params={"user": "alice"})
    nobodys = http(svc, "GET", "/v1/grammars/grammar-" + "0" * 32, key=GLOBEX_KEY,
                   params={"user": "alice"})
    assert theirs.status_code == nobodys.status_code == 404
    assert theirs.json()["error"]["code"] == nobodys.json()["error"]["code"]
    r = http(svc, "POST", "/v1/chat/completions", key=GLOBEX_KEY, json={
        "messages": ask("x"), "max_tokens": 2, "user": "alice", "grammar_id": gid})
    assert r.status_code == 404 and r.json()["error"]["code"] == "grammar_not_found"
    wait_idle()


def test_a_shared_system_prompt_is_computed_once_per_tenant(svc):
    """Prefix caching over HTTP, without sessions: a tenant's second request with the same
    long system prompt reports it cached (``usage.prompt_tokens_details``); another
    tenant sending the very same prompt starts from nothing of the first's."""
    system = "You label support tickets for the billing team. " * 12

    def send(key, text):
        r = http(svc, "POST", "/v1/chat/completions", key=key, json={
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": text}], "max_tokens": 2,
            "temperature": 0})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        return usage["prompt_tokens"], usage.get("prompt_tokens_details", {}).get(
            "cached_tokens", 0)

    assert send(GLOBEX_KEY, "My card was charged twice.")[1] == 0
    total, cached = send(GLOBEX_KEY, "Where is my refund?")
    assert cached >= len(system) // 8 and cached < total  # the system prompt, not the question
    assert send(ACME_KEY, "My card was charged twice.")[1] == 0  # not globex's
    assert send(ACME_KEY, "Where is my refund?")[1] >= cached  # acme's own
    wait_idle()


def test_bad_schema_fails_alone(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=ask("x"), max_tokens=5,
            extra_body={"guided_grammar": "root ::= missing_rule"})
    assert err.value.status_code == 400 and "grammar" in str(err.value)
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=5,
                                       extra_body={"guided_json": "{not json"})
    r = client.chat.completions.create(model=MODEL, messages=ask("Hi"), max_tokens=4)
    assert r.choices[0].message.content is not None
    wait_idle()


def test_client_errors(svc, client):
    bad = openai.OpenAI(base_url=svc.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=2)
    assert http(svc, "GET", "/v1/models", key=None).status_code == 401
    r = http(svc, "POST", "/v1/chat/completions", json={"messages": ask("x"), "temprature": 1})
    assert r.status_code == 400 and "temprature" in r.json()["error"]["message"]
    r = http(svc, "POST", "/v1/chat/completions", content=b"{nope")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = http(svc, "POST", "/v1/chat/completions", json={"messages": ask("x" * 1_100_000)})
    assert r.status_code == 413

    def chunked():  # no Content-Length: the limit must hold while the body is read
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(24):
            yield b"x" * 65536
        yield b'"}]}'
    r = http(svc, "POST", "/v1/chat/completions", content=chunked())
    assert r.status_code == 413 and "over the limit" in r.json()["error"]["message"], r.text
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 60}
                                            for i in range(4000)}}
    r = http(svc, "POST", "/v1/chat/completions",
             json={"messages": ask("x"), "guided_json": big})
    assert r.status_code == 413, r.text
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.chat.completions.create(model="gpt-9", messages=ask("x"), max_tokens=2)
    r = http(svc, "POST", "/v1/chat/completions",
             json={"messages": ask("x"), "n": 99})
    assert r.status_code == 400 and "n must be" in r.json()["error"]["message"]
    r = http(svc, "POST", "/v1/chat/completions",
             json={"messages": ask("x"), "max_tokens": 0})
    assert r.status_code == 400
    r = http(svc, "POST", "/v1/chat/completions",
             json={"messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    for body in (r.json(),):
        assert set(body["error"]) >= {"message", "type", "param", "code"}


def test_disconnect_mid_stream_releases_everything(svc):
    # exactly 3000 letters: the request cannot finish on its own within the test
    body = {"messages": ask("Write letters."), "max_tokens": 3000, "stream": True,
            "guided_regex": "[a-z]{3000}"}
    with httpx.stream("POST", svc.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status_code == 200
        lines = []
        for line in resp.iter_lines():
            if line.startswith("data:"):
                lines.append(line)
            if len(lines) >= 4:
                busy = worker_load()  # still reading: leaving the loop may close the stream
                break
        assert not any('"finish_reason":"' in line.replace(" ", "") for line in lines), lines
        assert busy["running"] + busy["waiting"] == 1 and busy["live_processors"] == 1, (
            busy, lines)
    # the client hung up: the request is aborted, its matcher and KV released
    wait_idle(timeout=10)


def test_load_tool_default_model(svc):
    """A short run of the load tool against the real default model: every request
    completes, every finished guided output is valid, nothing leaks."""
    import asyncio

    from deploy.loadtest import LoadConfig, LoadTest, format_report
    cfg = LoadConfig(url=svc.url, api_key=KEY, clients=8, requests=24, max_tokens=24,
                     duration_s=300, session_share=0.25, seed=1)
    r = asyncio.run(LoadTest(cfg).run())
    print(format_report(r))
    assert r["failed"] == 0, r["error_examples"]
    assert r["guided_checked"] > 5 and r["valid_share"] == 1.0, r["invalid_examples"]
    assert r["leaks"]["leak_free"], r["leaks"]


def readme_curl_bodies() -> list[dict]:
    """The JSON bodies of the README's curl examples (so the README and this test cannot
    drift apart)."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    bodies = []
    for m in re.finditer(r"curl (?:-N )?\$U -H \"\$H\" -d '(.*?)'", text, re.DOTALL):
        bodies.append(json.loads(m.group(1)))  # single quotes: the shell passes it as is
    return bodies


def test_readme_examples_give_valid_answers_at_defaults(svc):
    """Every curl in the README, sent as written (server defaults for everything it leaves
    out), answers with output that conforms to what it asked for."""
    bodies = readme_curl_bodies()
    assert len(bodies) >= 8
    # sent together, as a service's users would: the worker decodes them in one batch
    # (one after another they took 35 s of the suite; each answer is checked the same)
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(
            lambda body: http(svc, "POST", "/v1/chat/completions", json=body), bodies))
    for body, r in zip(bodies, answers):
        assert r.status_code == 200, (body, r.text)
        if body.get("stream"):
            assert "data: [DONE]" in r.text
            continue
        choice = r.json()["choices"][0]
        assert r.json()["model"] == MODEL
        content = choice["message"]["content"]
        rf = body.get("response_format") or {}
        if rf.get("type") == "json_schema":
            assert choice["finish_reason"] == "stop", (body, choice)
            jsonschema.validate(json.loads(content), rf["json_schema"]["schema"])
            assert choice["guided"]["validation"] == "valid"
        elif rf.get("type") == "json_object":
            assert isinstance(json.loads(content), dict)
        elif rf.get("type") == "regex_schema":
            assert re.fullmatch(rf["regex_schema"], content), content
        elif "guided_regex" in body:
            assert re.fullmatch(body["guided_regex"], content), content
        elif "guided_choice" in body:
            assert content in body["guided_choice"]
        elif "tools" in body:
            calls = choice["message"]["tool_calls"]
            assert choice["finish_reason"] == "tool_calls" and len(calls) >= 1
            names = [c["function"]["name"] for c in calls]
            assert len(set(json.dumps(c["function"], sort_keys=True) for c in calls)) == len(calls)
            for c in calls:
                assert c["function"]["name"] == "get_weather"
                assert isinstance(json.loads(c["function"]["arguments"])["city"], str), names
    wait_idle()
