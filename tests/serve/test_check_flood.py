"""A flood of grammar checks beside a polite client, through HTTP (issue 58, items 1-3): one
client sends ``POST /v1/grammars`` with distinct large schemas and ``wait_s: 0`` as fast as
it is answered, while a polite client sends plain requests to the same (only) worker.

What must hold (behaviour, not speed): the polite client is answered 200 every time; the
flood gets 429s with ``Retry-After`` (the worker's own compile queue is full:
``max_queued_compiles``), never a 5xx; at every sample the worker's compile queue and
report queue hold at most their bounds, and the checked-grammar store at most its bytes.
A check asked before its client's last Retry-After has passed is answered 429 by the edge
(deploy/refusals.py). The polite client's p99 with and without the flood is printed (the
issue's figure: within 2x), not asserted."""

import asyncio
import time

import httpx2 as httpx
import pytest
import ray

from cluster import launch
from cluster.config import ClusterConfig
from cluster.launch import free_port
from deploy import service

pytestmark = pytest.mark.integration

KEY = "check-flood-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUEUE = 4  # max_queued_compiles: the worker's own compile queue and its report queue
PROPERTIES = 1500  # required (llguidance builds them in the worker), distinct per check


@pytest.fixture(scope="module")
def svc(shared_ray, tiny_model_dir):
    with shared_ray():
        config = ClusterConfig(
            model=str(tiny_model_dir), num_workers=1,
            worker={"num_cpus": 1, "num_threads": 1},
            engine={"num_kv_blocks": 256, "max_model_len": 512},
            grammar_cache={"max_queued_compiles": QUEUE, "disk": False},
            scheduler={"load_poll_interval_s": 0.3})
        yield service.start(config, port=free_port(), api_key=KEY,
                            app_args={"max_body_bytes": 2_000_000})


def large_schema(n: int) -> dict:
    props = {f"k{n}_{j}": {"type": "integer"} for j in range(PROPERTIES)}
    return {"type": "object", "properties": props, "required": list(props)}


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def polite(http, count: int, latencies: list, codes: list) -> None:
    for i in range(count):
        t0 = time.monotonic()
        r = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"Say hi {i}."}], "max_tokens": 8,
            "user": "polite"})
        latencies.append(time.monotonic() - t0)
        codes.append(r.status_code)


async def flood(http, stop: asyncio.Event, statuses: dict, retry_after: set) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        r = await http.post("/v1/grammars", json={
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "f", "schema": large_schema(n)}}, "wait_s": 0})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code == 429:
            retry_after.add(r.headers.get("retry-after"))
            if "less than Retry-After ago" in r.json()["error"]["message"]:
                statuses["edge"] = statuses.get("edge", 0) + 1  # answered by the edge


async def sample_bounds(stop: asyncio.Event, seen: list) -> None:
    handles = launch.handles()
    worker, cache = handles["workers"][0], handles["cache"]
    while not stop.is_set():
        load = await worker.load.remote()
        stats = await cache.stats.remote()
        seen.append((load["grammar_client"], stats))
        await asyncio.sleep(0.2)


async def run(url: str, polite_count: int, flooding: bool):
    latencies, codes, statuses, retry_after, seen = [], [], {}, set(), []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120,
                                 limits=limits) as http:
        await polite(http, 2, [], [])  # warm: the first request's costs are not measured
        tasks = []
        if flooding:
            tasks = [asyncio.create_task(flood(http, stop, statuses, retry_after))
                     for _ in range(8)]
            tasks.append(asyncio.create_task(sample_bounds(stop, seen)))
            await asyncio.sleep(2.0)  # the flood has filled the queues by now
        await polite(http, polite_count, latencies, codes)
        stop.set()
        await asyncio.gather(*tasks)
    return latencies, codes, statuses, retry_after, seen


def test_a_check_flood_is_refused_and_bounded_beside_a_polite_client(svc):
    quiet, quiet_codes, _, _, _ = asyncio.run(run(svc.url, 30, flooding=False))
    loud, loud_codes, statuses, retry_after, seen = asyncio.run(run(svc.url, 30, True))
    checks = [s for s, _ in seen]
    print(f"\npolite p99 {p99(quiet):.3f} s alone, {p99(loud):.3f} s beside the flood "
          f"(x{p99(loud) / p99(quiet):.2f}); flood statuses {statuses}; most compiles "
          f"waiting {max(c['compiles_waiting'] for c in checks)}, reports waiting "
          f"{max(c['reports_waiting'] for c in checks)}, checked bytes "
          f"{max(s['checked_bytes'] for _, s in seen)}; refused "
          f"{checks[-1]['compiles_refused']}, displaced {checks[-1]['compiles_displaced']}, "
          f"throttled {checks[-1]['reports_throttled']}; slowest polite "
          f"{[round(x, 3) for x in sorted(loud)[-5:]]}, median {sorted(loud)[len(loud) // 2]:.3f}"
          f" (alone {sorted(quiet)[len(quiet) // 2]:.3f})")
    assert set(quiet_codes) == set(loud_codes) == {200}
    assert statuses.get(429, 0) > 0 and retry_after, statuses
    assert all(r.isdigit() and int(r) >= 1 for r in retry_after), retry_after
    # the client's compile share (grammar_cache.check_compile_share) refused some checks
    # before any compile, naming the wait in Retry-After
    assert checks[-1]["reports_throttled"] > 0, checks[-1]
    assert not [s for s in statuses if s != "edge" and s >= 500], statuses
    # a client that asks again before its Retry-After is answered by the edge
    # (deploy/refusals.py), without a route or a worker's call
    assert 0 < statuses.get("edge", 0) <= statuses[429], statuses
    assert seen and all(c["compiles_waiting"] <= 2 * QUEUE and c["reports_waiting"] <= QUEUE
                        for c in checks)
    assert all(s["checked_bytes"] <= s["checked_max_bytes"] for _, s in seen)
    # the flood's 202s left compiles behind: they finish, and the queue drains
    deadline = time.monotonic() + 120
    worker = launch.handles()["workers"][0]
    while ray.get(worker.load.remote())["grammar_client"]["compiles_waiting"]:
        assert time.monotonic() < deadline, "the worker's compile queue did not drain"
        time.sleep(0.5)
