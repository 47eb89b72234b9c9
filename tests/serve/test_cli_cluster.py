"""`rayguide up / status / down` as a user runs them. Marked slow (not in CI): it starts a
Ray head node with `ray start --head`. The head gets its own run dir, token file and free
ports, and `rayguide down` stops exactly its processes (never `ray stop`, which would stop
every Ray instance on the machine)."""

import json
import os
import subprocess
import sys

import httpx2 as httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def rayguide(tmp_path, *args, timeout=300):
    env = dict(os.environ, RAYGUIDE_RUN_DIR=str(tmp_path / "run"),
               RAY_AUTH_TOKEN_PATH=str(tmp_path / "token"))
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_up_status_down(tiny_model_dir, tmp_path):
    from cluster import launch

    record = None
    try:
        up = rayguide(tmp_path, "up", "--workers", "2", "--model", str(tiny_model_dir))
        assert up.returncode == 0, up.stderr
        assert "w0" in up.stdout and "w1" in up.stdout and "grammar cache" in up.stdout
        # the token was created (private to the user) and the banner says how to use it
        token = tmp_path / "token"
        assert token.stat().st_mode & 0o077 == 0 and len(token.read_text()) >= 32
        assert "RAY_AUTH_MODE=token" in up.stdout and str(token) in up.stdout
        record = json.loads((tmp_path / "run" / "head.json").read_text())
        assert record["dashboard"].startswith("http://127.0.0.1:")
        # token auth is on: the dashboard (Ray's job API) refuses a request without it
        r = httpx.get(record["dashboard"] + "/api/jobs/", timeout=10)
        assert r.status_code in (401, 403), r.text
        ok = httpx.get(record["dashboard"] + "/api/jobs/", timeout=10,
                       headers={"Authorization": f"Bearer {token.read_text().strip()}"})
        assert ok.status_code == 200
        st = rayguide(tmp_path, "status", "--json")
        assert st.returncode == 0, st.stderr
        assert len(json.loads(st.stdout.strip().splitlines()[-1])["workers"]) == 2
        table = rayguide(tmp_path, "status")
        assert table.returncode == 0, table.stderr
        for column in ("worker", "node", "device", "model", "running", "waiting", "KV used",
                       "sessions", "grammars", "uptime"):
            assert column in table.stdout.splitlines()[-5]
        down = rayguide(tmp_path, "down")
        assert down.returncode == 0 and "stopped 4 rayguide actors" in down.stdout, down
        assert "stopped the Ray head" in down.stdout
        assert launch.head_processes(record) == [] or not launch.head_alive(record)
        assert not (tmp_path / "run" / "head.json").exists()
        again = rayguide(tmp_path, "status")  # nothing recorded now: refuses, says why
        assert again.returncode == 1 and "--address" in again.stderr
    finally:
        if record is not None and launch.head_processes(record):
            launch.stop_ray_head(record)  # only this test's head
