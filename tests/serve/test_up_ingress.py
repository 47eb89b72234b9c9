"""`rayguide up`'s head runs Serve's HAProxy ingress for an app deployed on it later
(cluster/launch.py start_ray_head, cluster/ingress.py): `rayguide up` as a user runs it
(its own run dir, token and ports; one worker of the tiny random-weight model), the app
started on it as `rayguide serve --address` does (deploy/service.py ``start`` with the
head's address), a chat completion through it, HAProxy running from the head's directory
with its stats and Prometheus listeners on 127.0.0.1, and `rayguide down` taking HAProxy
and the directory away with the head. (`rayguide up / status / down` themselves:
test_cli_cluster.py, marked slow.)"""

import json
import os
import subprocess
import sys
import time

import httpx2 as httpx
import psutil
import pytest
import ray

from cluster import ingress, launch
from cluster.config import ClusterConfig
from deploy import service

pytestmark = pytest.mark.integration

KEY = "up-ingress-test-key"


def rayguide(tmp_path, *args, timeout=300):
    env = dict(os.environ, RAYGUIDE_RUN_DIR=str(tmp_path / "run"),
               RAY_AUTH_TOKEN_PATH=str(tmp_path / "token"))
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", ingress.HAPROXY_ENV):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _from_dir(workdir: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(workdir in arg for arg in proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _haproxy(workdir: str, port: int, timeout_s: float = 30.0) -> tuple[set, list[str]]:
    """What the HAProxy running from ``workdir`` listens on, and its config files, once
    it takes ``port``. Serve reloads HAProxy as replicas come and go (a new process, the
    old one drains and exits): a process that ends while it is looked at is skipped."""
    deadline = time.monotonic() + timeout_s
    while True:
        listening, configs = set(), []
        for proc in _from_dir(workdir):
            try:
                listening |= {(c.laddr.ip, c.laddr.port)
                              for c in proc.net_connections(kind="inet")
                              if c.status == psutil.CONN_LISTEN}
                configs += [arg for arg in proc.cmdline() if arg.endswith(".cfg")]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        if any(p == port for _, p in listening) or time.monotonic() > deadline:
            return listening, configs
        time.sleep(0.3)


def test_an_app_on_the_head_of_rayguide_up_is_served_through_haproxy(tiny_model_dir,
                                                                   tmp_path, monkeypatch):
    if ingress.haproxy_binary() is None:
        pytest.skip("no HAProxy binary (ray[serve] brings one on Linux)")
    record = svc = None
    mode = os.environ.get("RAY_AUTH_MODE")  # use_head_token sets it in this process
    try:
        up = rayguide(tmp_path, "up", "--workers", "1", "--model", str(tiny_model_dir))
        assert up.returncode == 0, up.stderr[-3000:]
        record = json.loads((tmp_path / "run" / "head.json").read_text())
        workdir = record["ingress_dir"]
        assert record["ingress"] == "haproxy" and os.path.isdir(workdir), record
        assert "RAY_SERVE_ENABLE_HA_PROXY=1 ray start --address=" in up.stdout
        # `rayguide serve --address <head>`: this process connects with the head's token
        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
        monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
        config = ClusterConfig(num_workers=1, model=str(tiny_model_dir),
                               address=record["address"])
        port = launch.free_port()
        launch.use_head_token(record)
        svc = service.start(config, port=port, api_key=KEY)
        assert not svc.started_ray and not svc.started_runtime
        r = httpx.post(svc.url + "/v1/chat/completions", timeout=120,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        # HAProxy took the endpoint's port, its config in the head's directory, and its
        # stats and Prometheus listeners (the shim's rewrite) on loopback
        listening, configs = _haproxy(workdir, port)
        assert ("127.0.0.1", port) in listening, (workdir, listening)
        assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening
        assert configs and all(c.startswith(workdir + "/") for c in configs), configs
        deadline = time.monotonic() + 10
        while True:  # (a reload rewrites the file, and the shim then rewrites its binds)
            text = open(configs[0]).read()
            binds = [line.split()[1] for line in text.splitlines()
                     if line.strip().startswith("bind ")]
            # the endpoint's, on its --host; the stats page and the Prometheus exporter,
            # rewritten to loopback by the shim
            if (f"127.0.0.1:{port}" in binds and len(binds) == 3
                    and all(b.startswith("127.0.0.1:") for b in binds)):
                break
            assert time.monotonic() < deadline, binds
            time.sleep(0.2)
        # `rayguide down` with the app still deployed (service.stop would first wait out
        # Serve's 30 s drain of a replica behind HAProxy): it goes with the head
        svc = None
        ray.shutdown()
        down = rayguide(tmp_path, "down")
        assert down.returncode == 0 and "stopped the Ray head" in down.stdout, down
        deadline = time.monotonic() + 15
        while _from_dir(workdir):
            assert time.monotonic() < deadline, _from_dir(workdir)
            time.sleep(0.3)
        assert not os.path.exists(workdir)
    finally:
        if svc is not None:
            service.stop(svc)
        if ray.is_initialized():
            ray.shutdown()
        if record is not None and launch.head_processes(record):
            launch.stop_ray_head(record)  # only this test's head
        # this process's Ray back to the auth mode it had: the tests after this one start
        # instances of their own, with no token (Ray caches the mode: read it again)
        from ray._raylet import AuthenticationTokenLoader, Config

        if mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = mode
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
