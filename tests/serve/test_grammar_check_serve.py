"""POST /v1/grammars end to end (issue 42, part 1): Ray Serve in front of the runtime (the
tiny model: what is checked is the grammar machinery, not the model's answers), the real
openai client for the requests that follow a check. What must hold: the check's
predictions are what requests then meet (a schema called refused is refused with the same
error, one called exact gives no answer invalid for it, the shortest output is never
more than a request needs), a later request finds the grammar compiled, and the route
speaks the API's auth, limits and error vocabulary. ``rayguide grammar check`` gives the
same report without the server."""

import json
import subprocess
import sys
import time

import httpx2 as httpx
import jsonschema
import openai
import pytest
import ray

from cluster import launch
from cluster.config import ClusterConfig
from cluster.launch import free_port
from deploy import service
from deploy.openai_api import client_identity
from deploy.tenants import DEFAULT_TENANT

pytestmark = pytest.mark.integration

KEY = "check-key"

EXACT = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
             "required": ["color"]},
    "items": {"type": "object", "properties": {"xs": {
        "type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 4}},
        "required": ["xs"]},
}
APPROXIMATED = {
    "unique": {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True,
        "maxItems": 3}}, "required": ["tags"]},
}
REFUSED = {
    "bad_pattern": {"type": "object", "properties": {"a": {"type": "string",
                                                           "pattern": "(("}}},
    "too_long": {"type": "object", "properties": {"a": {"type": "string",
                                                        "minLength": 100000}}},
    "bad_ref": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
}


@pytest.fixture(scope="module")
def svc(tiny_model_dir, shared_ray):
    config = ClusterConfig(model=str(tiny_model_dir), num_workers=1,
                           worker={"num_cpus": 1, "num_threads": 1},
                           engine={"num_kv_blocks": 256},
                           scheduler={"load_poll_interval_s": 0.3})
    with shared_ray():
        yield service.start(config, port=free_port(), api_key=KEY, num_replicas=2,
                            app_args={"max_body_bytes": 1_000_000})


@pytest.fixture(scope="module")
def client(svc):
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def http(svc, method, path, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, svc.url + path, headers=headers, timeout=120, **kw)


def response_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def check(svc, schema):
    r = http(svc, "POST", "/v1/grammars", json={"response_format": response_format(schema)})
    assert r.status_code == 200, r.text
    return r.json()


def ask(client, schema, max_tokens, n=1, seed=7):
    return client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format=response_format(schema), max_tokens=max_tokens, n=n, seed=seed,
        temperature=1.0)


def test_predictions_match_what_requests_do(svc, client):
    for name, schema in {**EXACT, **APPROXIMATED, **REFUSED}.items():
        report = check(svc, schema)
        expected = ("exact" if name in EXACT else "approximated" if name in APPROXIMATED
                    else "refused")
        assert report["status"] == expected, (name, report)
        assert report["id"].startswith("grammar-") and report["object"] == "grammar"
        if expected == "refused":
            error = report["error"]
            with pytest.raises(openai.APIStatusError) as caught:
                ask(client, schema, 32)
            # the request's error is the one the report predicted, status and code
            assert caught.value.status_code == error["status"], (name, report)
            assert caught.value.body["code"] == error["code"], (name, report)
            assert report["engine"] is None and report["shortest_output"]["tokens"] is None
            continue
        short = report["shortest_output"]
        assert short["tokens"] is not None and short["tokens"] >= short["at_least"] >= 1
        # a budget of the predicted shortest output is taken, and its answer is whole
        for budget in (short["tokens"], 64):
            r = ask(client, schema, budget, n=3)
            for choice in r.choices:
                guided = choice.model_extra["guided"]
                assert guided["engine"] == report["engine"], (name, report, guided)
                assert guided["approximated"] == report["approximated"], (name, guided)
                if expected == "exact":  # no answer invalid for an exact grammar
                    assert guided["validation"] == "valid", (name, budget, choice)
                    jsonschema.validate(json.loads(choice.message.content), schema)
            # the shortest output is never above what a request needed
            assert r.usage.completion_tokens >= 3 * short["at_least"], (name, r.usage)
        # under the lower bound the request is refused before generating, as predicted
        if short["at_least"] > 1:
            with pytest.raises(openai.BadRequestError) as caught:
                ask(client, schema, short["at_least"] - 1)
            assert caught.value.body["code"] == "budget_too_small"


def test_report_names_engines_and_keyword_paths(svc):
    report = check(svc, APPROXIMATED["unique"])
    assert report["engine"] == "xgrammar" and report["approximated"] == ["uniqueItems"]
    xg, ll = report["engines"]["xgrammar"], report["engines"]["llguidance"]
    assert xg["verdict"] == "approximated" and xg["source"] == "compile"
    assert {"path": "/properties/tags", "keyword": "uniqueItems"} in xg["keywords"]
    assert ll["verdict"] == "refused" and "uniqueItems" in ll["message"]
    assert {"path": "/properties/tags", "keyword": "uniqueItems"} in ll["keywords"]
    assert report["compile_ms"] > 0 and report["size_bytes"] > 0
    assert report["model"]
    exact = check(svc, EXACT["person"])
    assert exact["engine"] == "llguidance" and exact["approximated"] == []
    # a forced engine is part of the grammar (and of its id)
    forced = http(svc, "POST", "/v1/grammars", json={
        "response_format": response_format(EXACT["person"]),
        "guided_decoding_backend": "xgrammar"}).json()
    assert forced["engine"] == "xgrammar" and forced["id"] != exact["id"]
    # other dialects and tools are checked as a request would use them
    regex = http(svc, "POST", "/v1/grammars", json={"guided_regex": "[a-c]{3}"}).json()
    assert regex["kind"] == "regex" and regex["status"] == "compiled"
    assert regex["shortest_output"]["tokens"] >= 1
    tools = http(svc, "POST", "/v1/grammars", json={
        "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}}}}]}).json()
    assert tools["kind"] == "structural_tag" and tools["status"] == "compiled"


def report_family(schema):
    from deploy import dialects
    return dialects.json_schema(response_format(schema)["json_schema"]).family


def worker_grammar_log():
    return ray.get(launch.handles()["workers"][0].grammar_requests.remote())


def cache_stats():
    return ray.get(ray.get_actor(launch.CACHE_NAME, namespace=launch.NAMESPACE)
                   .stats.remote())


def test_a_checked_grammar_is_compiled_for_the_request_that_follows(svc, client):
    schema = {"type": "object", "properties": {"ids": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 2}},
        "required": ["ids"]}  # xgrammar's: compiled through the shared cache
    report = check(svc, schema)
    assert report["engine"] == "xgrammar" and report["cached"] is False
    compiles = cache_stats()["compiles"]
    r = client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "JSON"}],
        response_format=response_format(schema), max_tokens=24)
    assert r.choices[0].model_extra["guided"]["engine"] == "xgrammar"
    entry = worker_grammar_log()[-1]  # the one guided request since the check
    assert entry[1] == report_family(schema) and entry[3] is False  # ready: no wait
    assert cache_stats()["compiles"] == compiles  # nothing compiled again
    # a second check answers from the caches too
    again = check(svc, schema)
    assert again["cached"] is True and again["id"] == report["id"]


def test_grammar_id_get_and_requests(svc, client):
    schema = EXACT["enum"]
    report = check(svc, schema)
    gid = report["id"]
    got = http(svc, "GET", f"/v1/grammars/{gid}")
    assert got.status_code == 200 and got.json() == report
    # the cluster's copy is in the grammar cache actor, for every front end
    cache = ray.get_actor(launch.CACHE_NAME, namespace=launch.NAMESPACE)
    owner = client_identity(None, "127.0.0.1", DEFAULT_TENANT)  # the single key's tenant, no user
    assert ray.get(cache.checked.remote(owner, gid))[1]["id"] == gid
    # the id is this client's: another (here another user) finds nothing under it
    other = http(svc, "GET", f"/v1/grammars/{gid}", params={"user": "someone-else"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "grammar_not_found"
    # a request names the checked grammar instead of repeating it
    r = client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "A color?"}], max_tokens=16,
        extra_body={"grammar_id": gid})
    assert json.loads(r.choices[0].message.content)["color"] in ("red", "green", "blue")
    c = client.completions.create(model=None, prompt="Color:", max_tokens=16,
                                  extra_body={"grammar_id": gid})
    assert json.loads(c.choices[0].text)["color"] in ("red", "green", "blue")
    unknown = "grammar-" + "0" * 32
    r = http(svc, "GET", f"/v1/grammars/{unknown}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "grammar_not_found"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=None, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, extra_body={"grammar_id": unknown})
    assert caught.value.body["param"] == "grammar_id"
    for bad in ({"grammar_id": "nope"},
                {"grammar_id": gid, "response_format": response_format(schema)}):
        r = http(svc, "POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "grammar_id", r.text
    assert http(svc, "GET", "/v1/grammars/nope").status_code == 400


def test_a_compile_past_the_wait_is_answered_compiling_and_goes_on(svc, client):
    """The check answers within its wait: a compile still running is a 202 "compiling"
    with a Location; the compile is not cancelled, and GET gives the whole report once
    it is done (the same as a new check, which finds the grammar compiled)."""
    schema = {"type": "object", "properties": {"ids": {
        "type": "array", "items": {"type": "integer", "minimum": 3}, "uniqueItems": True,
        "maxItems": 3}}, "required": ["ids"]}  # xgrammar's: a round trip to the cache
    r = http(svc, "POST", "/v1/grammars",
             json={"response_format": response_format(schema), "wait_s": 0})
    assert r.status_code == 202, r.text
    pending = r.json()
    assert pending["status"] == "compiling" and pending["engine"] is None
    assert pending["shortest_output"] == {} and pending["error"] is None
    assert r.headers["location"] == f"/v1/grammars/{pending['id']}"
    assert r.headers["retry-after"] == "1"
    for _ in range(120):
        got = http(svc, "GET", r.headers["location"])
        if got.status_code != 202:
            break
        assert got.json()["status"] == "compiling"
        time.sleep(0.5)
    assert got.status_code == 200, got.text
    final = got.json()
    assert final["id"] == pending["id"] and final["engine"] == "xgrammar"
    assert final["status"] == "approximated" and final["shortest_output"]["at_least"] > 0
    again = check(svc, schema)
    assert again["cached"] is True and again["status"] == final["status"]
    assert again["shortest_output"] == final["shortest_output"]
    for bad in (-1, 601, "soon"):
        r = http(svc, "POST", "/v1/grammars",
                 json={"response_format": response_format(schema), "wait_s": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "wait_s", r.text


def test_same_auth_limits_and_errors_as_the_other_routes(svc):
    body = {"response_format": response_format(EXACT["person"])}
    for key in (None, "wrong"):
        r = http(svc, "POST", "/v1/grammars", key=key, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert http(svc, "GET", "/v1/grammars/grammar-" + "0" * 32, key=None).status_code == 401
    r = http(svc, "POST", "/v1/grammars", json={"guided_json": {}, "guided_regex": "a"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http(svc, "POST", "/v1/grammars", json={"temperature": 0.5})
    assert r.status_code == 400 and "no grammar to check" in r.json()["error"]["message"]
    r = http(svc, "POST", "/v1/grammars", json={**body, "typo_field": 1})
    assert r.status_code == 400 and "typo_field" in r.json()["error"]["message"]
    r = httpx.post(svc.url + "/v1/grammars", content=b"x" * 2_000_000, timeout=120,
                   headers={"Authorization": f"Bearer {KEY}",
                            "Content-Type": "application/json"})
    assert r.status_code == 413
    r = http(svc, "POST", "/v1/grammars", json={**body, "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "/v1/grammars" in http(svc, "GET", "/openapi.json").json()["paths"]


def test_command_line_gives_the_server_s_report(svc, tiny_model_dir, tmp_path, capsys):
    files = []
    for name, schema in (("exact", EXACT["person"]), ("approx", APPROXIMATED["unique"]),
                         ("refused", REFUSED["bad_pattern"])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(schema))
        files.append((path, schema))
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"guided_regex": "[a-c]{3}"}))
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "grammar", "check", "--json", "--model",
         str(tiny_model_dir), *[str(p) for p, _ in files], str(body)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr  # one of them is refused
    local = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(local) == 4
    served = [check(svc, schema) for _, schema in files]
    served.append(http(svc, "POST", "/v1/grammars", json={"guided_regex": "[a-c]{3}"}).json())
    for mine, theirs in zip(local, served):
        for field in ("id", "kind", "status", "engine", "approximated"):
            assert mine[field] == theirs[field], (field, mine, theirs)
        assert mine["shortest_output"]["at_least"] == theirs["shortest_output"]["at_least"]
        assert {n: v["verdict"] for n, v in mine["engines"].items()} == \
            {n: v["verdict"] for n, v in theirs["engines"].items()}
    # the text report: the same command's main in this process (a second subprocess paid
    # its imports and tokenizer load again, ~5 s)
    from cli.main import main

    capsys.readouterr()
    code = main(["grammar", "check", "--model", str(tiny_model_dir), str(files[1][0])])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "approximated on xgrammar" in out and "uniqueItems at /properties/tags" in out
