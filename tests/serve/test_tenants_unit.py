"""Tenants (deploy/tenants.py): the keys file's parsing and its errors at start, the tenant
a key is let in as, and the tenant as the root of a client's sessions and checked grammar
ids, through the server's request path with fake runtimes (no Ray). The same through Ray
Serve: tests/serve/test_serve.py::test_tenants_are_apart."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from core.grammar_spec import GrammarSpec, grammar_id
from deploy import openai_api as api
from deploy import tenants
from deploy.errors import APIError
from deploy.settings import AppSettings
from grammar_cache.checked import CheckedGrammars
from tests.serve.fakes import SERVER, edge_server
from tests.serve.test_session_owner_unit import SessionRuntime

pytestmark = pytest.mark.unit

ACME, ACME_NEW, GLOBEX = "acme-key-0001", "acme-key-0002", "globex-key-01"
KEYS_FILE = f"""\
# tenant: key
acme: {ACME}
# the key being rotated in, stored hashed (a '#' after a key is part of the key)
acme: sha256:{tenants.key_digest(ACME_NEW)}

globex: {GLOBEX}
"""


def write(tmp_path, text, name="keys.txt"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# the keys file -------------------------------------------------------------------------

def test_a_keys_file_maps_each_key_to_its_tenant():
    table = tenants.parse_keys(KEYS_FILE)
    assert table == {tenants.key_digest(ACME): "acme", tenants.key_digest(ACME_NEW): "acme",
                     tenants.key_digest(GLOBEX): "globex"}
    assert tenants.tenant_of(table, ACME_NEW) == "acme"
    assert tenants.tenant_of(table, GLOBEX) == "globex"
    assert tenants.tenant_of(table, "not-a-key-at-all") is None
    assert tenants.tenant_of(table, "") is None
    # the hex of a key is not the key: it lets nobody in
    assert tenants.tenant_of(table, tenants.key_digest(ACME)) is None


@pytest.mark.parametrize("text, says", [
    ("acme sk-0123456789", "line 1: expected 'tenant: key'"),
    ("\n\nacme corp: sk-0123456789", "line 3: the tenant name 'acme corp'"),
    ("acme:", "tenant 'acme' has no key"),
    ("acme: short", "at least 8 characters"),
    ("acme: sk-01234 56789", "without spaces"),
    ("acme: sha256:abc", "64 hex digits"),
    (f"acme: {ACME}\nglobex: {ACME}", "line 2: this key is already given (to tenant 'acme')"),
    (f"acme: {ACME}\nglobex: sha256:{tenants.key_digest(ACME)}", "already given"),
    ("# only a comment\n\n", "names no tenant"),
])
def test_a_bad_keys_file_is_refused_naming_the_line(tmp_path, text, says):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as err:
        tenants.read_keys_file(path)
    assert says in str(err.value) and path in str(err.value)
    assert ACME not in str(err.value) and "sk-0123" not in str(err.value)  # no secret


def test_a_keys_file_that_cannot_be_read_is_named(tmp_path):
    with pytest.raises(ValueError, match="cannot read the keys file .*missing.txt"):
        tenants.read_keys_file(str(tmp_path / "missing.txt"))


def test_the_app_reads_the_keys_file_at_build_and_ships_only_digests(tmp_path, monkeypatch):
    monkeypatch.delenv("RAYGUIDE_API_KEY", raising=False)
    monkeypatch.delenv("RAYGUIDE_KEYS_FILE", raising=False)
    path = write(tmp_path, KEYS_FILE)
    settings = AppSettings.from_args({"keys_file": path})
    assert settings.keyed and settings.api_key is None
    shipped = json.dumps(settings.model_dump())
    assert ACME not in shipped and GLOBEX not in shipped  # the replicas get digests
    replica = AppSettings(**settings.model_dump())  # what a replica builds
    assert tenants.tenant_of(replica.key_table(), GLOBEX) == "globex"
    # from the environment too, and beside a single api_key (tenant "default")
    monkeypatch.setenv("RAYGUIDE_KEYS_FILE", path)
    both = AppSettings.from_args({"api_key": "the-single-key"})
    assert tenants.tenant_of(both.key_table(), "the-single-key") == "default"
    assert tenants.tenant_of(both.key_table(), ACME) == "acme"
    # a bad file stops the build, naming it (serve run / serve deploy / rayguide serve)
    monkeypatch.setenv("RAYGUIDE_KEYS_FILE", write(tmp_path, "acme sk", "bad.txt"))
    with pytest.raises(ValueError, match="bad.txt', line 1"):
        AppSettings.from_args(None)
    monkeypatch.delenv("RAYGUIDE_KEYS_FILE")
    with pytest.raises(ValueError, match="also in the keys file, as tenant 'acme'"):
        AppSettings.from_args({"keys_file": path, "api_key": ACME})
    with pytest.raises(ValueError, match="tenant_keys"):
        AppSettings.from_args({"tenant_keys": {"not-hex": "acme"}})


def test_rayguide_serve_refuses_a_bad_keys_file_before_starting(tmp_path, capsys):
    from cli.main import main

    path = write(tmp_path, "acme: sk-0123456789\nglobex: sk-0123456789")
    assert main(["serve", "--keys-file", path]) == 2
    err = capsys.readouterr().err
    assert "line 2: this key is already given" in err and "sk-0123456789" not in err


def test_a_keys_file_opens_a_non_loopback_host():
    from deploy import exposure

    assert exposure.open_refusal("0.0.0.0", None, False) is not None
    assert exposure.open_refusal("0.0.0.0", "keys.txt", False) is None


# the tenant a request is let in as --------------------------------------------------------

def request(body=None, host="10.1.2.3", key=None, query=None):
    raw = json.dumps(body or {}).encode()

    async def stream():
        yield raw
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return SimpleNamespace(headers=headers, client=SimpleNamespace(host=host),
                           url=SimpleNamespace(path="/v1/chat/completions"), stream=stream,
                           query_params=query or {})


def keyed(runtime, **settings):
    return edge_server(runtime, api_key="the-single-key",
                       tenant_keys=tenants.parse_keys(KEYS_FILE), **settings)


def test_a_key_not_in_the_file_is_a_401_and_each_key_is_its_tenant():
    srv = keyed(SessionRuntime())
    for key in (None, "wrong-key-123", tenants.key_digest(ACME)):
        with pytest.raises(APIError) as err:
            SERVER._auth(srv, request(key=key))
        assert err.value.status == 401 and err.value.code == "invalid_api_key"
    assert SERVER._auth(srv, request(key=ACME)) == "acme"
    assert SERVER._auth(srv, request(key=ACME_NEW)) == "acme"
    assert SERVER._auth(srv, request(key=GLOBEX)) == "globex"
    assert SERVER._auth(srv, request(key="the-single-key")) == "default"
    assert SERVER._auth(edge_server(SessionRuntime()), request(key="anything")) is None


# sessions -------------------------------------------------------------------------------

SECRET = "the secret plan is to meet at noon by the old mill"


def chat(srv, content, key, user="alice", host="10.0.0.1", sid="conv-1"):
    body = {"messages": [{"role": "user", "content": content}], "session_id": sid,
            "user": user}
    out = asyncio.run(srv._serve(request(body, host=host, key=key),
                                 api.ChatCompletionRequest, api.plan_chat))
    return out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def delete(srv, key, user="alice", host="10.0.0.1", sid="conv-1"):
    return asyncio.run(SERVER.end_session(srv, sid, request(key=key, host=host,
                                                            query={"user": user})))


def test_another_tenant_sending_the_same_user_reaches_nothing_of_a_session():
    srv = keyed(SessionRuntime())
    chat(srv, SECRET, ACME)
    # globex names the same user, session id and address: its DELETE is the 404 of an
    # unknown session, and its turn runs in a session of its own, with no cached tokens
    # from acme's prompt
    answers = []
    for sid in ("conv-1", "never-made"):
        with pytest.raises(APIError) as err:
            delete(srv, GLOBEX, sid=sid)
        answers.append((err.value.status, err.value.code, err.value.message.replace(
            sid, "ID")))
    assert answers[0] == answers[1] and answers[0][:2] == (404, "session_not_found")
    assert chat(srv, SECRET + " at noon", GLOBEX) == 0
    assert delete(srv, GLOBEX)["deleted"] is True  # globex's own
    assert len(srv.runtime.sessions) == 1  # acme's lives on
    # within acme, user is the namespace: another address or the rotated key continues
    assert chat(srv, SECRET, ACME_NEW, host="10.9.9.9") > 0
    assert delete(srv, ACME_NEW, host="10.9.9.9")["deleted"] is True
    assert not srv.runtime.sessions


# checked grammar ids --------------------------------------------------------------------

class CheckedRuntime:
    """The runtime's checked-grammar store (RuntimeClient.remember_checked / checked)."""

    def __init__(self):
        self.store = CheckedGrammars()

    async def checked(self, owner, grammar_id):
        return self.store.get(owner, grammar_id)


def get_grammar(srv, gid, key, user="alice"):
    return asyncio.run(SERVER.get_grammar(srv, gid, request(key=key), user))


def test_another_tenant_sending_the_same_user_gets_the_404_of_an_unknown_grammar_id():
    srv = keyed(CheckedRuntime())
    spec = GrammarSpec.regex("[a-z]+")
    gid = grammar_id(spec)
    owner = SERVER._client(srv, request(key=ACME), "alice")
    srv.runtime.store.put(owner, gid, spec, {"id": gid, "status": "ok"})
    # acme, with either of its keys: the report
    for key in (ACME, ACME_NEW):
        assert json.loads(get_grammar(srv, gid, key).body)["id"] == gid
    answers = []
    for asked in (gid, "grammar-" + "0" * 32):  # acme's id, and an id nobody has
        with pytest.raises(APIError) as err:
            get_grammar(srv, asked, GLOBEX)
        answers.append((err.value.status, err.value.code, err.value.message.replace(
            asked, "ID")))
    assert answers[0] == answers[1] and answers[0][0] == 404
    # and a request naming acme's id from globex plans nothing from it
    assert asyncio.run(srv._named(gid, SERVER._client(srv, request(key=GLOBEX), "alice"))
                       ) is None
