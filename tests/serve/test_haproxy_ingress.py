"""The HAProxy ingress (deploy/service.py, the default where ``rayguide serve`` starts Ray):
HAProxy in front of a replica that serves HTTP itself, on a Ray instance of this module's
own, started by ``service.start`` as ``rayguide serve`` does. (The other modules' shared
instance is the test session's, not rayguide's, and runs Serve's proxy: they restart Serve
on one Ray instance, which is no path of rayguide's. The `rayguide serve` processes of
test_serve_cli, test_serve_ops and test_reasoning_serve run HAProxy.) Streamed and whole
answers through the real ``openai`` client, the key and the Host checked, a client that
hangs up has its request aborted, HAProxy and the replica listen on loopback only, and
nothing of HAProxy is left once the service stops. Tiny random-weight model."""

import os
import time

import httpx2 as httpx
import openai
import psutil
import pytest
import ray

from cluster import launch
from cluster.config import ClusterConfig
from cluster.launch import free_port
from deploy import service

pytestmark = pytest.mark.integration

KEY = "haproxy-test-key"


def _haproxies(workdir: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            if any(workdir in arg for arg in proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.fixture(scope="module")
def svc(tiny_model_dir):
    if service.haproxy_binary() is None:
        pytest.skip("no HAProxy binary (ray[serve] brings one on Linux)")
    config = ClusterConfig(num_workers=1, model=str(tiny_model_dir),
                           worker={"num_cpus": 1, "num_threads": 1},
                           engine={"num_kv_blocks": 256, "speculative": False})
    started = service.start(config, port=free_port(), api_key=KEY, ingress="haproxy")
    try:
        yield started
    finally:
        service.stop(started)
        if ray.is_initialized():
            ray.shutdown()


def _idle(timeout: float = 20.0) -> dict:
    worker = launch.handles()["workers"][0]
    deadline = time.monotonic() + timeout
    while True:
        load = ray.get(worker.load.remote())
        if load["running"] + load["waiting"] == 0 and load["live_processors"] == 0:
            return load
        assert time.monotonic() < deadline, load
        time.sleep(0.2)


def test_haproxy_serves_the_endpoint_on_loopback_only(svc):
    assert svc.ingress == "haproxy" and svc.ingress_dir
    client = openai.OpenAI(base_url=svc.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    whole = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
        extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 12
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    bad = httpx.get(svc.url + "/v1/models", headers={"Authorization": "Bearer wrong"},
                    timeout=60)
    assert bad.status_code == 401
    # the replica sees a loopback connection (HAProxy's) and the client's own Host header:
    # a DNS name re-pointed at 127.0.0.1 is still refused (deploy/exposure.py)
    port = int(svc.url.rsplit(":", 1)[1])
    rebound = httpx.get(svc.url + "/v1/models", timeout=60,
                        headers={"Authorization": f"Bearer {KEY}",
                                 "Host": f"attacker.example:{port}"})
    assert rebound.status_code == 421, rebound.text
    assert rebound.json()["error"]["code"] == "invalid_host"
    deadline = time.monotonic() + 30  # (a reload's old process may end as it is read)
    while True:
        procs = _haproxies(svc.ingress_dir)
        listening = [c for p in procs for c in _connections(p)
                     if c.status == psutil.CONN_LISTEN]
        if port in {c.laddr.port for c in listening} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert procs, "no HAProxy runs from this service's directory"
    assert port in {c.laddr.port for c in listening}, listening
    assert {c.laddr.ip for c in listening} == {"127.0.0.1"}, listening
    # the replica's own HTTP server: on the endpoint's host too
    replica_ports = [c for p in psutil.process_iter(["name"])
                     if "ServeRepli" in (p.info["name"] or "")
                     for c in _connections(p)
                     if c.status == psutil.CONN_LISTEN and c.laddr.port in launch.REPLICA_PORTS]
    assert replica_ports and {c.laddr.ip for c in replica_ports} == {"127.0.0.1"}


def _connections(proc) -> list:
    """A process's inet sockets; none for one that exited meanwhile (Serve reloads
    HAProxy: the old process ends while the new one serves)."""
    try:
        return proc.net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def test_a_client_that_hangs_up_through_haproxy_has_its_request_aborted(svc):
    """Its replica learns of it through HAProxy and aborts the request: the engine stops
    long before the 1,900 tokens it would otherwise make (one step a token: speculation
    is off in this module)."""
    worker = launch.handles()["workers"][0]
    steps = ray.get(worker.load.remote())["steps"]
    body = {"messages": [{"role": "user", "content": "Write letters."}], "max_tokens": 1900,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", svc.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status_code == 200, resp.read()
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("data:")
            if seen >= 4:
                busy = ray.get(worker.load.remote())
                break
    assert busy["running"] == 1, busy
    done = _idle()
    assert done["steps"] - steps < 950, (steps, done)


def test_nothing_of_haproxy_is_left_after_stop(svc, tiny_model_dir):
    """A second service in a process of its own (the module's is still up: two instances on
    one machine, each with its own HAProxy files and ports), stopped there."""
    import subprocess
    import sys

    script = ("import sys; sys.path.insert(0, %r)\n"
              "import urllib.request\n"
              "from cluster.config import ClusterConfig\n"
              "from cluster.launch import free_port\n"
              "from deploy import service\n"
              "config = ClusterConfig(num_workers=1, model=sys.argv[1], worker={'num_cpus': "
              "1, 'num_threads': 1}, engine={'num_kv_blocks': 64})\n"
              "svc = service.start(config, port=free_port(), api_key='k' * 16, "
              "ingress='haproxy')\n"
              "req = urllib.request.Request(svc.url + '/v1/models', "
              "headers={'Authorization': 'Bearer ' + 'k' * 16})\n"
              "assert urllib.request.urlopen(req, timeout=60).status == 200\n"
              "print(svc.ingress, svc.ingress_dir, flush=True)\n"
              "service.stop(svc)\n") % os.getcwd()
    out = subprocess.run([sys.executable, "-c", script, str(tiny_model_dir)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    ingress, workdir = out.stdout.split()[-2:]
    assert ingress == "haproxy" and workdir != svc.ingress_dir
    deadline = time.monotonic() + 15
    while _haproxies(workdir):
        assert time.monotonic() < deadline, _haproxies(workdir)
        time.sleep(0.3)
    assert not os.path.exists(workdir)
    assert _haproxies(svc.ingress_dir)  # the module's own HAProxy was not disturbed


def test_the_replica_queue_is_bounded_behind_haproxy(svc):
    """Serve's own backpressure holds where the replica takes HTTP itself: past 2 ongoing
    and 2 queued requests, a 429 with Retry-After at once (redeploys the app: run last)."""
    import asyncio
    from collections import Counter

    service._deploy({**svc.app_args, "max_ongoing_requests": 2, "max_queued_requests": 2})

    async def flood(n: int):
        async with httpx.AsyncClient(base_url=svc.url, timeout=120,
                                     headers={"Authorization": f"Bearer {KEY}"},
                                     limits=httpx.Limits(max_connections=n + 5)) as http:
            async def one():
                r = await http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Letters."}],
                    "max_tokens": 400, "ignore_eos": True})
                return r.status_code, r.headers.get("retry-after")
            return await asyncio.gather(*(one() for _ in range(n)))

    results = asyncio.run(flood(12))
    codes = Counter(code for code, _ in results)
    assert set(codes) <= {200, 429}, results
    assert codes[429] >= 1 and codes[200] >= 2, results
    assert all(retry is not None for code, retry in results if code == 429), results
    _idle()
