"""`rayguide up / status / down` as a user runs them. Marked slow (not in CI): it starts a
Ray head node with `ray start --head` on the default ports, and stops it again."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def rayguide(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_up_status_down(tiny_model_dir):
    try:
        up = rayguide("up", "--workers", "2", "--model", str(tiny_model_dir))
        assert up.returncode == 0, up.stderr
        assert "w0" in up.stdout and "w1" in up.stdout and "grammar cache" in up.stdout
        st = rayguide("status", "--json")
        assert st.returncode == 0, st.stderr
        assert len(json.loads(st.stdout.strip().splitlines()[-1])["workers"]) == 2
        down = rayguide("down")
        assert down.returncode == 0 and "stopped" in down.stdout
    finally:
        from cluster.launch import ray_executable

        subprocess.run([ray_executable(), "stop", "--force"], capture_output=True, timeout=120)
