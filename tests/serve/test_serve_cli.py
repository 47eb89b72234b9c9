"""The two ways a user starts the endpoint from a shell, as real processes: `rayguide serve`
(runtime + app in the foreground, Ctrl-C stops it: tests/serve/test_serve_ops.py, which
also reads its log) and `serve run <config.yaml>` (Ray Serve's own command; the first
replica starts the runtime). Tiny random-weight model."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import yaml

from cluster.launch import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited early with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError("the endpoint did not become healthy")


def interrupt(proc: subprocess.Popen, timeout: float = 90.0) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("did not stop within 90 s of Ctrl-C") from None


def default_sigint() -> None:
    """(In the child, before exec.) Ctrl-C's default action. A shell that starts this suite
    in the background (`make test &`) starts it with SIGINT ignored, a child inherits that,
    and Python then installs no KeyboardInterrupt handler: `serve run` would never see the
    Ctrl-C sent here. (`rayguide serve` sets its own handler, so it needs none of this.)"""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def guided_request(url: str, key: str | None = None) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key or "none", max_retries=0,
                           timeout=60)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "?"}],
                                       max_tokens=4, extra_body={"guided_choice": ["A", "B"]})
    return r.choices[0].message.content


def env() -> dict:
    e = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    e.pop("RAY_ADDRESS", None)
    return e


def test_serve_run_config_file(tiny_model_dir, tmp_path):
    """`serve run` on a config like deploy/serve_config.yaml: the replica finds no runtime
    and starts one from the app's args."""
    port = free_port()
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args.update(model=str(tiny_model_dir), num_workers=1,
                engine={"num_kv_blocks": 128})
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(tmp_path / "serve_run.log", "w+")
    proc = subprocess.Popen([str(BIN / "serve"), "run", str(path)], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env=env(), start_new_session=True,
                            preexec_fn=default_sigint)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        assert guided_request(url) in ("A", "B")
    finally:
        interrupt(proc)
