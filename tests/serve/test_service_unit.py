"""deploy/service.py without Ray: what ``start`` asks of the Ray instance it starts."""

import pytest

from cluster import launch
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
