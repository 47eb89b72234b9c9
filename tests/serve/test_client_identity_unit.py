"""The client identity the edge gives every request (deploy/openai_api.client_identity),
for the grammar cache's fair share of compiles: the OpenAI ``user`` when given, else the
connection's address, under the tenant the checked API key belongs to; short and opaque.
Through the server's request path (fakes, no Ray) it reaches every GenerationRequest of
the plan."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from core.request import RequestOutput
from deploy import openai_api as api
from tests.serve.fakes import edge_server

pytestmark = pytest.mark.unit

identity = api.client_identity


def test_the_user_field_names_the_client_else_the_address():
    assert identity("alice", "10.0.0.1", "k") == identity("alice", "10.0.0.2", "k")
    assert identity("alice", "10.0.0.1", "k") != identity("bob", "10.0.0.1", "k")
    assert identity(None, "10.0.0.1", "k") != identity(None, "10.0.0.2", "k")
    assert identity("", "10.0.0.1", "k") == identity(None, "10.0.0.1", "k")
    # a user named like an address is not that address's client
    assert identity("10.0.0.1", "10.0.0.9", "k") != identity(None, "10.0.0.1", "k")
    assert identity(None, None, None) == identity(None, None, None)


def test_two_tenants_never_share_a_line():
    assert identity("alice", "h", "acme") != identity("alice", "h", "globex")
    assert identity(None, "h", "acme") != identity(None, "h", "globex")
    assert identity("alice", "h", None) != identity("alice", "h", "acme")
    # no user, no address and a tenant named like the open root: still apart
    assert identity("alice", "h", "open") != identity("alice", "h", None)
    # the tenant's hash is the prefix: one tenant's clients are recognisable as one's
    assert (identity("alice", "h", "acme").split(".")[0]
            == identity("bob", "g", "acme").split(".")[0])


@pytest.mark.parametrize("user", ["alice", "x" * 10_000, "\U0001F600 \ud800 émile"])
def test_the_identity_is_short_and_opaque(user):
    tenant = "secret-tenant-123"
    got = identity(user, "192.168.1.20", tenant)
    assert len(got) <= 24 and got.isascii()
    for raw in (user[:8], tenant, "secret", "192.168"):
        assert raw not in got
    assert identity(user, "192.168.1.20", tenant) == got  # stable: one client, one line


class FakeRuntime:
    def __init__(self):
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        yield RequestOutput(request.request_id, text="ok", token_ids=[1], finished=True,
                            finish_reason="stop", prompt_tokens=3, completion_tokens=1)


def server(**settings):
    return edge_server(FakeRuntime(), **settings)


def request(body: dict, host="10.1.2.3", key=None, path="/v1/chat/completions"):
    raw = json.dumps(body).encode()

    async def stream():
        yield raw
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return SimpleNamespace(headers=headers, client=SimpleNamespace(host=host),
                           url=SimpleNamespace(path=path), stream=stream)


def serve(srv, body, planner=api.plan_chat, cls=api.ChatCompletionRequest, **kw):
    return asyncio.run(srv._serve(request(body, **kw), cls, planner))


CHAT = {"messages": [{"role": "user", "content": "hi"}], "guided_choice": ["a", "b"]}


def test_every_request_of_a_plan_carries_the_client_identity():
    srv = server(api_key="the-key")  # the single key is tenant "default"
    serve(srv, {**CHAT, "user": "polite", "n": 3}, key="the-key")
    assert [r.client for r in srv.runtime.requests] == [
        identity("polite", "10.1.2.3", "default")] * 3
    serve(srv, {"prompt": ["one", "two"], "max_tokens": 2}, api.plan_completion,
          api.CompletionRequest, host="10.9.9.9", key="the-key", path="/v1/completions")
    assert [r.client for r in srv.runtime.requests[3:]] == [
        identity(None, "10.9.9.9", "default")] * 2


def test_a_tenants_keys_make_one_client_and_two_tenants_two():
    from deploy.tenants import key_digest

    srv = server(tenant_keys={key_digest("acme-key-1"): "acme",
                              key_digest("acme-key-2"): "acme",
                              key_digest("globex-key"): "globex"})
    for key in ("acme-key-1", "acme-key-2", "globex-key"):
        serve(srv, {**CHAT, "user": "alice"}, key=key)
    one, rotated, other = (r.client for r in srv.runtime.requests)
    assert one == rotated == identity("alice", "10.1.2.3", "acme")  # a key being rotated
    assert other == identity("alice", "10.1.2.3", "globex") != one


def test_a_key_the_server_does_not_check_makes_no_new_client():
    srv = server()  # no API key: any bearer passes, so it must not split the address's line
    serve(srv, CHAT, key="made-up-1")
    serve(srv, CHAT, key="made-up-2")
    first, second = (r.client for r in srv.runtime.requests)
    assert first == second == identity(None, "10.1.2.3", None)


def test_a_batch_jobs_requests_are_one_client_of_their_own():
    from deploy import batch_job

    item = batch_job.parse_line('{"prompt": "hi", "regex": "a+"}', 1, defaults={},
                                default_grammar=None, run_tag="t")
    assert item.error is None and item.request.client == batch_job.BATCH_CLIENT
    assert item.request.client != identity(None, None, None)
