"""On a real Serve (no model, no runtime): an app built while Serve's proxies listen on
0.0.0.0 (a Serve config's ``http_options.host``) is refused without an API key; on
loopback it is built."""

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def serve_open(shared_ray):
    from ray import serve

    from cluster.launch import free_port

    with shared_ray():
        serve.start(http_options={"host": "0.0.0.0", "port": free_port()})
        yield


def test_build_app_reads_the_proxies_host_and_refuses(serve_open, monkeypatch):
    from deploy import serve_app

    monkeypatch.delenv("RAYGUIDE_API_KEY", raising=False)
    assert serve_app.serve_http_host() == "0.0.0.0"
    with pytest.raises(ValueError, match="refusing to serve on 0.0.0.0"):
        serve_app.build_app({"num_workers": 1, "start_runtime": False})
    serve_app.build_app({"num_workers": 1, "start_runtime": False, "api_key": "k"})


def test_a_replica_of_an_app_built_unchecked_refuses(serve_open, monkeypatch):
    """``serve run deploy.serve_app:app`` builds without the check: the replica refuses."""
    from ray import serve

    from deploy import serve_app
    from deploy.settings import AppSettings

    monkeypatch.delenv("RAYGUIDE_API_KEY", raising=False)
    app = serve_app._application(AppSettings(start_runtime=False, num_workers=1))
    try:
        with pytest.raises(RuntimeError, match="failed"):
            serve.run(app, name="open-refused", route_prefix="/open", blocking=False)
        status = serve.status().applications["open-refused"]
        message = status.deployments["OpenAIServer"].message
        assert "refusing to serve on 0.0.0.0" in message, message
    finally:
        serve.delete("open-refused")


def test_service_start_refuses_before_ray_starts(monkeypatch):
    from deploy import service

    def init(*_a, **_k):
        raise AssertionError("Ray started before the refusal")

    monkeypatch.setattr(service.ray, "init", init)
    monkeypatch.setattr(service.launch, "connect", init)
    with pytest.raises(ValueError, match="refusing to serve on 0.0.0.0"):
        service.start(service.ClusterConfig(), host="0.0.0.0")
