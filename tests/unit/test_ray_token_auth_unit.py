"""Ray's token and where a head listens, without Ray (docs/security.md, "Ray token
authentication" and "Loopback by default"): `rayguide up` starts `ray start --head` with
RAY_AUTH_MODE=token and a token file it creates private (a $RAY_AUTH_TOKEN wins), puts the
dashboard on 127.0.0.1 unless `--listen` names another address, and says how to use the
token; `rayguide serve` turns token auth on for its private instance unless the user set
RAY_AUTH_MODE."""

import stat
from pathlib import Path

import pytest

from cli.main import _head_banner, main
from cluster import launch
from cluster.ingress import remove_workdir
from cluster.config import ClusterConfig
from deploy import service

pytestmark = pytest.mark.unit


class _Stop(Exception):
    pass


@pytest.fixture
def head(monkeypatch, tmp_path):
    """start_ray_head with a fake `ray start`: what it would run, and with what environment."""
    monkeypatch.setenv("RAYGUIDE_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "secret" / "token"))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    seen = {}

    class FakePopen:
        def __init__(self, cmd, env, **_kw):
            seen["cmd"], seen["env"], self.pid, self.returncode = cmd, env, 4242, 0

        def communicate(self, timeout=None):
            return "", None

    monkeypatch.setattr(launch.subprocess, "Popen", FakePopen)
    made = []

    def start(**kwargs):
        record = launch.start_ray_head(**kwargs)
        made.append(Path(record["temp_dir"]))
        ingress_dirs.append(record["ingress_dir"])
        return record, seen

    ingress_dirs = []
    yield start
    for temp in made:  # a long run dir gets a short one in /tmp
        if temp.is_dir() and not temp.is_relative_to(tmp_path):
            temp.rmdir()
    for workdir in ingress_dirs:  # HAProxy's directory (cluster/ingress.py), in /tmp
        remove_workdir(workdir)


def test_up_starts_its_head_with_token_auth_and_a_private_token_file(head, tmp_path):
    record, seen = head()
    token = tmp_path / "secret" / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) >= 32
    assert seen["env"]["RAY_AUTH_MODE"] == "token"
    assert seen["env"]["RAY_AUTH_TOKEN_PATH"] == str(token)
    assert record["token_path"] == str(token)
    banner = _head_banner(record)
    assert "export RAY_AUTH_MODE=token" in banner and str(token) in banner
    before = token.read_text()
    head()  # an existing token is kept
    assert token.read_text() == before


def test_up_uses_a_token_from_the_environment_and_writes_none(head, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t" * 32)
    record, seen = head()
    assert seen["env"]["RAY_AUTH_MODE"] == "token" and seen["env"]["RAY_AUTH_TOKEN"] == "t" * 32
    assert record["token_path"] is None and not (tmp_path / "secret" / "token").exists()


def test_up_puts_the_dashboard_on_loopback_unless_told_to_listen(head, monkeypatch, tmp_path):
    _, seen = head()
    assert "--dashboard-host=127.0.0.1" in seen["cmd"]
    assert not any(a.startswith("--node-ip-address") for a in seen["cmd"])
    record, seen = head(listen="10.0.0.7")
    assert "--dashboard-host=10.0.0.7" in seen["cmd"]
    assert "--node-ip-address=10.0.0.7" in seen["cmd"]
    assert record["address"].startswith("10.0.0.7:")
    # `rayguide up` with no --listen asks for loopback
    asked = []

    def start_ray_head(**kwargs):
        asked.append(kwargs)
        raise ValueError("stopped by the test")

    monkeypatch.setenv("RAYGUIDE_RUN_DIR", str(tmp_path / "empty"))
    monkeypatch.setattr(launch, "start_ray_head", start_ray_head)
    assert main(["up"]) == 1
    assert asked and asked[0]["listen"] == "127.0.0.1"


def _modes_set_by_serve(monkeypatch) -> list:
    modes = []

    def init(**kwargs):
        raise _Stop  # nothing of Ray starts

    monkeypatch.setattr(service.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(service.ray, "init", init)
    monkeypatch.setattr(launch, "fast_death_notice", lambda: None)
    monkeypatch.setattr(launch, "set_auth_mode", modes.append)
    start = service.start  # ray.init is faked above (named so for the unit-file check)
    with pytest.raises(_Stop):
        start(ClusterConfig(num_workers=1))
    return modes


def test_serve_turns_token_auth_on_for_its_private_instance(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert _modes_set_by_serve(monkeypatch) == ["token"]
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a user's own setting wins
    assert _modes_set_by_serve(monkeypatch) == []
