"""Operations helpers without Ray: the status table, the refusal of down/status with no
target, and stopping exactly one recorded head's processes."""

import subprocess
import sys
import time

import pytest

from cluster import launch

pytestmark = pytest.mark.unit


def test_down_and_status_refuse_without_a_target(tmp_path, monkeypatch):
    monkeypatch.setenv(launch.RUN_DIR_ENV, str(tmp_path))
    with pytest.raises(ConnectionError, match="--address"):
        launch.connect_target(None)
    assert not __import__("ray").is_initialized()  # it never tried "auto"


def test_status_table_columns():
    st = {"workers": [{"worker_id": "w0", "node_id": "abcdef0123456789", "device": "cpu",
                       "model": "SmolLM2-135M-Instruct", "running": 2, "waiting": 1,
                       "free_blocks": 96, "total_blocks": 128, "live_sessions": 3,
                       "grammar_cache": {"compiles": 5}, "uptime_s": 3725}],
          "grammar_cache": {"entries": 4, "bytes": 2e6, "compiles": 5, "hits": 9},
          "scheduler": {"workers": {"w0": {}}, "sessions": 3, "routes": 10}}
    header, row, cache, sched = launch.status_table(st).splitlines()
    assert header.split()[:4] == ["worker", "node", "device", "model"]
    assert row.split() == ["w0", "abcdef012345", "cpu", "SmolLM2-135M-Instruct", "2", "1",
                           "32/128", "(25%)", "3", "5", "-", "1h02m"]  # no prefix looked up
    assert "4 grammars cached" in cache and "1 workers registered" in sched
    assert "10 routes (0 by prefix)" in sched


def test_status_table_shows_each_workers_prefix_hit_rate():
    """Of the prompt tokens a worker's prefix cache looked up, the share found cached; "-"
    for a worker that looked up none (or whose engine does not report them)."""
    def worker(worker_id, **counts):
        return {"worker_id": worker_id, "uptime_s": 5, **counts}

    st = {"workers": [worker("w0", prefix_cache_query_tokens=4000,
                             prefix_cache_hit_tokens=3700),
                      worker("w1", prefix_cache_query_tokens=0, prefix_cache_hit_tokens=0),
                      worker("w2")],
          "grammar_cache": {},
          "scheduler": {"workers": {}, "sessions": 0, "routes": 9, "prefix_routes": 7}}
    header, *rows, cache, sched = launch.status_table(st).splitlines()
    assert "prefix hits" in header
    assert [r.split()[-2] for r in rows] == ["92%", "-", "-"]
    assert "9 routes (7 by prefix)" in sched


def _sleeper():
    # a stand-in for a head's processes: its own session, "ray" in its command line
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "ray"],
                            start_new_session=True)


def test_stop_ray_head_stops_only_its_session(tmp_path, monkeypatch):
    monkeypatch.setenv(launch.RUN_DIR_ENV, str(tmp_path))
    mine, other = _sleeper(), _sleeper()
    try:
        record = {"session_id": mine.pid, "temp_dir": str(tmp_path)}
        launch.head_record_path().write_text(__import__("json").dumps(record))
        assert launch.head_processes(record) == [mine.pid]
        assert launch.stop_ray_head(record, grace_s=5) == 1
        assert mine.wait(10) is not None
        time.sleep(0.2)
        assert other.poll() is None  # another session: left alone
        assert launch.recorded_head() is None
    finally:
        for p in (mine, other):
            if p.poll() is None:
                p.kill()


def test_free_ports_lie_outside_the_range_of_outgoing_connections():
    """A server's port from free_port is not one the kernel can hand to an outgoing
    connection (which took a test's proxy port between the pick and the bind) nor one of
    Ray's worker ports nor one of the ports Serve gives its replicas under direct ingress;
    a preferred port is kept where it is free."""
    import socket

    below = launch.ephemeral_ports_from()
    ports = {launch.free_port() for _ in range(200)}
    assert all(launch.SERVER_PORTS_FROM <= p < below for p in ports), sorted(ports)
    assert not ports & set(launch.REPLICA_PORTS), sorted(ports & set(launch.REPLICA_PORTS))
    assert len(ports) > 40  # spread, not one port every time
    with socket.socket() as held:
        held.bind(("", 0))
        taken = held.getsockname()[1]
        assert launch.free_port(taken) != taken  # busy: another one
    assert launch.free_port(taken) == taken  # free again: kept
