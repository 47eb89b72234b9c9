"""deploy/service.py without Ray: what ``start`` asks of the Ray instance it starts."""

import pytest

from cluster import ingress, launch
from cluster.config import ClusterConfig
from deploy import service

pytestmark = pytest.mark.unit


class _Stop(Exception):
    pass


def _init_options(monkeypatch) -> dict:
    seen = {}

    def init(**kwargs):
        seen.update(kwargs)
        raise _Stop  # nothing of Ray starts

    monkeypatch.setattr(service.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(service.ray, "init", init)
    monkeypatch.setattr(launch, "fast_death_notice", lambda: None)
    monkeypatch.setattr(launch, "set_auth_mode", lambda mode: None)
    start = service.start  # faked ray.init: nothing of Ray starts (named so for the
    with pytest.raises(_Stop):  # import test's check that unit files start no Ray)
        start(ClusterConfig(num_workers=1))
    return seen


def test_private_instance_has_no_metrics_exporter_and_no_dashboard(monkeypatch):
    monkeypatch.delenv(launch.METRICS_ENV, raising=False)
    seen = _init_options(monkeypatch)
    assert seen["address"] == "local"
    assert seen["include_dashboard"] is False
    assert seen["_system_config"] == {"enable_metrics_collection": False}


def test_a_users_metrics_setting_wins(monkeypatch):
    monkeypatch.setenv(launch.METRICS_ENV, "1")
    assert "_system_config" not in _init_options(monkeypatch)


def _env_at_init(monkeypatch, **start_kwargs) -> dict:
    """The environment ``ray.init`` (the raylet, and so every Ray process) starts with."""
    import os

    seen = {}

    def init(**kwargs):
        seen.update(os.environ)
        raise _Stop

    monkeypatch.setattr(service.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(service.ray, "init", init)
    monkeypatch.setattr(launch, "fast_death_notice", lambda: None)
    monkeypatch.setattr(launch, "set_auth_mode", lambda mode: None)
    start = service.start
    with pytest.raises(_Stop):
        start(ClusterConfig(num_workers=1), **start_kwargs)
    return seen


def test_haproxy_ingress_gets_its_own_files_and_ports_while_ray_starts(monkeypatch, tmp_path):
    """HAProxy is the default where a binary is installed; its switch, and its files and
    ports made this instance's own (Serve's defaults are shared by every instance on the
    machine), are in Ray's environment as it starts and gone from this process's after."""
    import os

    monkeypatch.setattr(ingress, "haproxy_binary", lambda: "/bin/haproxy")
    monkeypatch.delenv(service.HAPROXY_ENV, raising=False)
    first = _env_at_init(monkeypatch)
    second = _env_at_init(monkeypatch)
    assert ClusterConfig().serve.ingress == "haproxy"
    for env in (first, second):
        assert env[service.HAPROXY_ENV] == "1"
        assert env["RAY_SERVE_HAPROXY_SOCKET_PATH"].startswith(
            env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])
        assert not env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"].startswith("/tmp/haproxy-serve")
    for key in ("RAY_SERVE_HAPROXY_SERVER_STATE_BASE", "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC",
                "RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_HAPROXY_BINARY_PATH"):
        assert first[key] != second[key], key
    ports = {first[k] for k in first if k.endswith("_PORT")}
    assert len(ports) == 4 and ports.isdisjoint({"8404", "9101", "8500", "9500"}), ports
    assert service.HAPROXY_ENV not in os.environ
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in os.environ


def test_proxy_ingress_and_a_missing_haproxy_start_serves_python_proxy(monkeypatch):
    import os

    monkeypatch.setenv(service.HAPROXY_ENV, "1")  # a user's shell: restored after
    monkeypatch.setattr(ingress, "haproxy_binary", lambda: "/bin/haproxy")
    assert _env_at_init(monkeypatch, ingress="proxy")[service.HAPROXY_ENV] == "0"
    assert os.environ[service.HAPROXY_ENV] == "1"
    monkeypatch.setattr(ingress, "haproxy_binary", lambda: None)
    env = _env_at_init(monkeypatch, ingress="haproxy")
    assert env[service.HAPROXY_ENV] == "0"
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in env or \
        env["RAY_SERVE_HAPROXY_STATS_PORT"] == os.environ.get("RAY_SERVE_HAPROXY_STATS_PORT")
    with pytest.raises(ValueError, match="ingress must be"):
        service.choose_ingress("nginx")


def test_the_ingress_setting_is_checked():
    with pytest.raises(ValueError, match="serve.ingress"):
        ClusterConfig(serve={"ingress": "nginx"})
    assert ClusterConfig(serve={"ingress": "proxy"}).serve.ingress == "proxy"


def test_the_haproxy_shim_binds_stats_and_prometheus_to_loopback_and_becomes_the_binary(
        tmp_path):
    """Serve writes `bind *:PORT` (stats) and `bind :PORT` (Prometheus): every interface.
    The shim Ray runs instead rewrites those two in the config it is given and then execs
    the binary with the same arguments; the endpoint's `bind HOST:PORT` stays."""
    import subprocess

    env = service.ingress_environment("haproxy", workdir=str(tmp_path), binary="/bin/echo")
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text("frontend prometheus\n    bind :9101\n    mode http\n"
                   "frontend http_frontend\n    bind 0.0.0.0:8000\n"
                   "listen stats\n  bind *:8404\n  stats enable\n")
    out = subprocess.run([env["RAY_SERVE_HAPROXY_BINARY_PATH"], "-db", "-f", str(cfg),
                          "-sf", "12"], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["-db", "-f", str(cfg), "-sf", "12"]
    text = cfg.read_text()
    assert "bind 127.0.0.1:9101" in text and "bind 127.0.0.1:8404" in text
    assert "bind 0.0.0.0:8000" in text  # the endpoint's host is the user's choice
    assert "bind :" not in text and "bind *:" not in text
