"""The open-endpoint refusal outside the CLI: an app built from a Serve config whose
``http_options.host`` is not loopback, with no API key and no ``allow_open``, is refused
by ``build_app`` (which asks the Serve controller for the host), by each replica as it
starts (an app deployed without ``build_app``). No Ray here: tests/serve/test_open_endpoint_serve.py
checks the controller lookup on a real Serve, and ``service.start``."""

import pytest

import deploy.serve_app as serve_app

pytestmark = pytest.mark.unit

SERVER = getattr(serve_app.OpenAIServer, "func_or_class", serve_app.OpenAIServer)
ARGS = {"num_workers": 1, "start_runtime": False}


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch):
    monkeypatch.delenv("RAYGUIDE_API_KEY", raising=False)


@pytest.fixture
def serve_on(monkeypatch):
    """Serve's proxies listen on the host given (as the controller would say)."""
    def on(host):
        monkeypatch.setattr(serve_app, "serve_http_host", lambda: host)
    return on


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.7"])
def test_build_app_refuses_an_open_endpoint(serve_on, host):
    serve_on(host)
    with pytest.raises(ValueError) as err:
        serve_app.build_app(ARGS)
    message = str(err.value)
    assert f"refusing to serve on {host}" in message and "http_options.host" in message
    assert "api_key" in message and "allow_open: true" in message


def test_build_app_serves_with_a_key_an_opt_in_or_on_loopback(serve_on, monkeypatch):
    serve_on("0.0.0.0")
    serve_app.build_app({**ARGS, "api_key": "k"})
    serve_app.build_app({**ARGS, "allow_open": True})
    monkeypatch.setenv("RAYGUIDE_API_KEY", "from-env")
    serve_app.build_app(ARGS)
    monkeypatch.delenv("RAYGUIDE_API_KEY")
    for host in ("127.0.0.1", None):  # None: no Serve to ask yet (the replica asks)
        serve_on(host)
        serve_app.build_app(ARGS)


def test_build_app_is_a_serve_app_builder():
    """Serve calls an app builder with exactly one parameter (the args dict)."""
    import inspect

    assert len(inspect.signature(serve_app.build_app).parameters) == 1


def test_a_replica_refuses_before_it_starts_anything(monkeypatch):
    def handles():
        raise AssertionError("the replica looked for the runtime before refusing")

    monkeypatch.setattr(serve_app.launch, "handles", handles)
    own = SERVER.__mro__[1]  # the class as written (Serve's ingress wraps it)
    # Serve's ingress gives the class a copy of the module's globals: patch that copy
    monkeypatch.setitem(own.__init__.__globals__, "serve_http_host", lambda: "0.0.0.0")
    with pytest.raises(ValueError, match="refusing to serve on 0.0.0.0"):
        own.__init__(object.__new__(SERVER), dict(ARGS))
