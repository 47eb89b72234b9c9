"""`rayguide up`'s head and Serve's ingress, without Ray (cluster/ingress.py,
cluster/launch.py start_ray_head): the head starts with HAProxy's environment (its switch,
a short directory of its own with the loopback shim, free ports), recorded, so that an app
deployed on it later runs behind HAProxy; `--ingress proxy` (or no HAProxy binary) starts
it with Serve's Python proxy; `rayguide down` removes the directory with the head. The
same on a real head: tests/serve/test_up_ingress.py."""

import logging
import os
import subprocess
import time
from pathlib import Path

import pytest

from cli.main import _head_banner, main
from cluster import ingress, launch

pytestmark = pytest.mark.unit

NODE_ID_DIR = 56  # Serve puts HAProxy's sockets in a directory named by the node's id
HAPROXY_SOCKET_MAX = 97


@pytest.fixture
def head(monkeypatch, tmp_path):
    """start_ray_head with a fake `ray start`: the record and the environment it ran with."""
    monkeypatch.setenv("RAYGUIDE_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t" * 32)
    monkeypatch.setattr(ingress, "haproxy_binary", lambda: "/opt/haproxy/bin/haproxy")
    seen = {}

    class FakePopen:
        returncode = 0

        def __init__(self, cmd, env, **_kw):
            seen["cmd"], seen["env"], self.pid = cmd, env, 4242

        def communicate(self, timeout=None):
            return "boom", None

    monkeypatch.setattr(launch.subprocess, "Popen", FakePopen)
    made = []

    def start(**kwargs):
        record = launch.start_ray_head(**kwargs)
        made.append(record)
        return record, seen["env"]

    start.popen = FakePopen
    yield start
    for record in made:
        ingress.remove_workdir(record["ingress_dir"])
        temp = Path(record["temp_dir"])  # a long run dir gets a short one in /tmp
        if temp.is_dir() and not temp.is_relative_to(tmp_path):
            temp.rmdir()


def test_the_head_starts_with_haproxys_environment_in_a_short_directory_of_its_own(
        head, monkeypatch):
    monkeypatch.setattr(launch, "head_processes", lambda record: [])
    record, env = head()
    workdir = record["ingress_dir"]
    assert record["ingress"] == "haproxy" and os.path.isdir(workdir)
    assert env[ingress.HAPROXY_ENV] == "1"
    assert env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] == workdir
    for key in ("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "RAY_SERVE_HAPROXY_SOCKET_PATH",
                "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH", "RAY_SERVE_HAPROXY_SERVER_STATE_FILE"):
        # what Serve makes of it: <dir>/<node id>/<file>, within HAProxy's limit
        path = os.path.join(workdir, "n" * NODE_ID_DIR, os.path.basename(env[key]))
        assert env[key].startswith(workdir + "/") and len(path) <= HAPROXY_SOCKET_MAX, path
    shim = Path(env["RAY_SERVE_HAPROXY_BINARY_PATH"])
    assert shim.parent == Path(workdir) and os.access(shim, os.X_OK)
    assert "exec /opt/haproxy/bin/haproxy" in shim.read_text()
    assert {"8404", "9101", "8500", "9500"}.isdisjoint(
        env[k] for k in env if k.startswith("RAY_SERVE_") and k.endswith("_PORT"))
    assert ingress.HAPROXY_ENV not in os.environ  # this process's own is left alone
    # `rayguide down`: the directory goes with the head, and the record
    launch.stop_ray_head(record)
    assert not os.path.exists(workdir) and launch.recorded_head() is None


def test_proxy_or_no_haproxy_binary_starts_the_head_with_the_python_proxy(
        head, monkeypatch, caplog):
    record, env = head(ingress="proxy")
    assert env[ingress.HAPROXY_ENV] == "0" and "RAY_SERVE_HAPROXY_BINARY_PATH" not in env
    assert record["ingress"] == "proxy" and record["ingress_dir"] is None
    monkeypatch.setattr(ingress, "haproxy_binary", lambda: None)
    with caplog.at_level(logging.WARNING, logger="cluster.ingress"):
        record, env = head(ingress="haproxy")
    assert record["ingress"] == "proxy" and env[ingress.HAPROXY_ENV] == "0"
    assert "no HAProxy binary" in caplog.text
    with pytest.raises(ValueError, match="ingress must be"):
        head(ingress="nginx")


def test_a_failed_ray_start_leaves_no_haproxy_directory(head, monkeypatch):
    monkeypatch.setattr(head.popen, "returncode", 1)
    before = set(Path("/tmp").glob(ingress.WORKDIR_PREFIX + "*"))
    with pytest.raises(ConnectionError, match="boom"):
        head()
    assert set(Path("/tmp").glob(ingress.WORKDIR_PREFIX + "*")) <= before


def test_a_dead_heads_directory_goes_when_a_new_head_starts(head, monkeypatch, tmp_path):
    dead, _ = head()  # recorded
    monkeypatch.setattr(launch, "head_alive", lambda record: False)
    fresh, _ = head()
    assert not os.path.exists(dead["ingress_dir"]) and os.path.isdir(fresh["ingress_dir"])
    # a record edited to name some other directory: that one is never removed
    ingress.remove_workdir(str(tmp_path))
    assert tmp_path.is_dir()


def test_down_stops_the_heads_haproxy_whatever_its_binary_is_called(tmp_path):
    """HAProxy runs in the head's session; its command line names the head's directory,
    not necessarily Ray (a system haproxy)."""
    workdir = tmp_path / "rgh-test"
    workdir.mkdir()
    proc = subprocess.Popen(["sh", "-c", "sleep 60; true", str(workdir)], start_new_session=True)
    try:
        record = {"session_id": proc.pid, "ingress_dir": str(workdir)}
        deadline = time.monotonic() + 10
        while str(workdir) not in launch._cmdline(proc.pid):  # until it has exec'd sh
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert proc.pid in launch.head_processes(record)  # (and sh's child, while it forks)
        assert launch.head_processes({**record, "ingress_dir": None}) == []
    finally:
        proc.kill()
        proc.wait()


def test_up_takes_the_ingress_from_the_flag_else_the_config(monkeypatch, tmp_path):
    asked = []

    def start_ray_head(**kwargs):
        asked.append(kwargs["ingress"])
        raise ValueError("stopped by the test")

    monkeypatch.setenv("RAYGUIDE_RUN_DIR", str(tmp_path / "empty"))
    monkeypatch.setattr(launch, "start_ray_head", start_ray_head)
    config = tmp_path / "rayguide.yaml"
    config.write_text("serve: {ingress: proxy}\n")
    assert main(["up"]) == 1
    assert main(["up", "--ingress", "proxy"]) == 1
    assert main(["up", "--config", str(config)]) == 1
    assert main(["up", "--config", str(config), "--ingress", "haproxy"]) == 1
    assert asked == ["haproxy", "proxy", "proxy", "haproxy"]


def test_the_banner_says_the_ingress_and_how_a_node_joins_with_it():
    record = {"address": "10.0.0.5:6379", "dashboard": "http://10.0.0.5:8265",
              "token_path": "/t", "ingress": "haproxy", "ingress_dir": "/tmp/rgh-x"}
    banner = _head_banner(record)
    assert "HAProxy (its files in /tmp/rgh-x)" in banner
    assert "RAY_SERVE_ENABLE_HA_PROXY=1 ray start --address=10.0.0.5:6379" in banner
    banner = _head_banner({**record, "ingress": "proxy", "ingress_dir": None})
    assert "Python proxy" in banner and "RAY_SERVE_ENABLE_HA_PROXY" not in banner
    old = {k: v for k, v in record.items() if not k.startswith("ingress")}
    assert "Python proxy" in _head_banner(old)  # a head recorded before: no HAProxy env
