"""`rayguide serve` as an operator sees it, as real processes on real Ray: in the foreground
with an API key, a clean log from start to Ctrl-C, `rayguide down` / `status` with their
defaults leave a serve they were not pointed at alone, and a scheduler killed for good is
rebuilt. Tiny random-weight model.

Each serve runs its own private Ray instance (in its process) on free ports; the tests stop
only what they started, never with `ray stop`."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from cluster.launch import free_port
from tests.serve.test_serve_cli import guided_request, interrupt, wait_healthy

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# what a normal start and stop must not print (Ray's and ours)
ALARMING = re.compile(r"WARNING|Traceback|ERROR|Error:|failed", re.IGNORECASE)


def env(tmp_path) -> dict:
    e = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}",
             # an empty run dir: no `rayguide up` head is recorded for these tests
             RAYGUIDE_RUN_DIR=str(tmp_path / "run"))
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE"):  # the defaults a user has
        e.pop(name, None)
    return e


def start_serve(tiny_model_dir, tmp_path, port: int, log_name: str, *args: str):
    log_path = tmp_path / log_name
    log = open(log_path, "w+")
    proc = subprocess.Popen(
        [str(BIN / "rayguide"), "serve", "--port", str(port), "--workers", "1",
         "--model", str(tiny_model_dir), *args],
        stdout=log, stderr=subprocess.STDOUT, text=True, env=env(tmp_path), cwd=ROOT,
        start_new_session=True)
    return proc, log_path


def rayguide(tmp_path, *args, timeout=120):
    return subprocess.run([str(BIN / "rayguide"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env(tmp_path), cwd=ROOT)


def ray_address(log_path: Path) -> str:
    m = re.search(r"Ray ready at (\S+)", log_path.read_text())
    assert m, log_path.read_text()
    return m.group(1)


def test_serve_foreground_clean_log_and_down_status_leave_it_alone(tiny_model_dir, tmp_path):
    """`rayguide serve` in the foreground with an API key: its banner names the endpoint,
    the key is required, Ctrl-C stops it (exit 0, the port closed), and from start to stop
    it logs nothing alarming."""
    port = free_port()
    proc, log_path = start_serve(tiny_model_dir, tmp_path, port, "serve.log", "--api-key", "k1")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        # the banner (printed once the app is up) names the endpoint and how to call it
        deadline = time.monotonic() + 30
        while not re.search(r"^curl ", log_path.read_text(), re.M):
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        assert f"http://127.0.0.1:{port}/v1" in log_path.read_text()
        assert guided_request(url, "k1") in ("A", "B")
        with pytest.raises(openai.AuthenticationError):
            guided_request(url, "wrong")
        # one line per start stage, with its time (the runtime's stages may be printed just
        # after /health answers: the app starts beside the runtime, so wait for them)
        stages = [re.escape(s) + r".*\(\d+\.\d s\)" for s in (
            "Ray ready", "grammar cache ready", "worker(s) loaded the model",
            "registered with the scheduler", "Serve controller", "app ready")]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = log_path.read_text()
            if all(re.search(s, text) for s in stages):
                break
            time.sleep(0.2)
        for stage in stages:
            assert re.search(stage, text), (stage, text)
        # down / status with their defaults: this machine has no `rayguide up` head, so
        # they refuse, naming what to pass; they never attach to the serve's Ray
        down = rayguide(tmp_path, "down")
        assert down.returncode == 1 and "--address" in down.stderr, down
        status = rayguide(tmp_path, "status")
        assert status.returncode == 1 and "--address" in status.stderr, status
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        # pointed at it, status reads it (token auth: ~/.ray/auth_token, as Ray made it)
        st = subprocess.run([str(BIN / "rayguide"), "status", "--address", ray_address(log_path)],
                            capture_output=True, text=True, timeout=120,
                            env=dict(env(tmp_path), RAY_AUTH_MODE="token"), cwd=ROOT)
        assert st.returncode == 0, st.stderr
        assert re.search(r"^w0\s", st.stdout, re.M) and "grammar cache:" in st.stdout
    finally:
        code = interrupt(proc)
    assert code == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)
    lines = log_path.read_text().splitlines()
    bad = [line for line in lines if ALARMING.search(line)]
    assert not bad, "\n".join(lines)
    assert lines[-1].startswith("rayguide: shutting down") or "Deleting app" in lines[-1]


KILL_SCHEDULER = """
import sys, ray
ray.init(address=sys.argv[1], namespace="rayguide", log_to_driver=False)
ray.kill(ray.get_actor("rayguide_scheduler", namespace="rayguide"), no_restart=True)
"""


def test_serve_rebuilds_a_scheduler_killed_for_good(tiny_model_dir, tmp_path):
    port = free_port()
    proc, log_path = start_serve(tiny_model_dir, tmp_path, port, "serve_heal.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        kill = subprocess.run([sys.executable, "-c", KILL_SCHEDULER, ray_address(log_path)],
                              capture_output=True, text=True, timeout=120,
                              env=dict(env(tmp_path), RAY_AUTH_MODE="token"))
        assert kill.returncode == 0, kill.stderr
        deadline = time.monotonic() + 240
        while "rebuilt rayguide_scheduler" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.25)
        wait_healthy(url, proc)
        assert guided_request(url) in ("A", "B")  # the new front end reaches the new scheduler
    finally:
        code = interrupt(proc)
    assert code == 0, log_path.read_text()
