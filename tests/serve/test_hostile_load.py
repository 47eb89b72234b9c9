"""A hostile crowd against the real stack (Ray Serve, scheduler, one worker with a tiny
random-weight model and the real tokenizer, real xgrammar): 100 clients at once that
disconnect mid-stream, send garbage, open sessions and abandon them, and send huge stop
lists and prompts, while one polite client keeps asking for guided output. The server
answers no 5xx, the polite client is served every time, /health stays 200, and once the
crowd is gone the worker holds nothing: no running requests, matchers or KV blocks, and the
abandoned sessions end on their idle timeout."""

import asyncio
import json
import os
import random
import re
import time

import httpx2 as httpx
import pytest
import ray

from cluster import launch
from cluster.config import ClusterConfig
from cluster.launch import free_port
from deploy import service

pytestmark = pytest.mark.integration

KEY = "hostile-key"
CLIENTS = int(os.environ.get("RAYGUIDE_HOSTILE_CLIENTS", "100"))
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def svc(tiny_model_dir, shared_ray):
    config = ClusterConfig(model=str(tiny_model_dir), num_workers=1,
                           worker={"num_cpus": 1, "num_threads": 1},
                           engine={"num_kv_blocks": 256, "max_model_len": 512},
                           scheduler={"load_poll_interval_s": 0.3,
                                      "session_idle_timeout_s": 5.0})
    with shared_ray():  # cleared also when the start fails
        yield service.start(config, port=free_port(), api_key=KEY,
                            app_args={"max_body_bytes": 1_000_000, "max_prompt_chars": 50_000})


def ask(text):
    return [{"role": "user", "content": text}]


async def disconnect_mid_stream(http, rng):
    body = {"messages": ask("Letters."), "stream": True, "max_tokens": 200,
            "guided_regex": "[a-z]{200}"}
    async with http.stream("POST", CHAT, json=body) as r:
        n = 0
        async for _ in r.aiter_lines():
            n += 1
            if n >= rng.randint(1, 6):
                break  # hang up mid-stream
    return r.status_code


async def garbage(http, rng):
    raw = rng.choice([b"{", b"\x00\xff" * 50, b"[" * 5000, b'{"messages": 5}',
                      json.dumps({"messages": ask("x"), "tools": [5]}).encode(),
                      json.dumps({"messages": ask("x"), "guided_json": {"type": "nope"}}).encode()])
    r = await http.post(CHAT, content=raw, headers={"Content-Type": "application/json"})
    return r.status_code


async def abandoned_session(http, rng):
    body = {"messages": ask("Hi"), "max_tokens": 4, "session_id": f"abandon-{rng.random()}",
            "guided_choice": ["yes", "no"]}
    r = await http.post(CHAT, json=body)
    return r.status_code  # never ended: the idle timeout must collect it


async def huge_stops(http, rng):
    body = {"messages": ask("x"), "max_tokens": 4, "stop": ["z" * 10] * 100_000}
    r = await http.post(CHAT, json=body)
    assert r.status_code in (400, 413), r.text
    return r.status_code


async def huge_prompt(http, rng):
    body = {"messages": ask("word " * 60_000), "max_tokens": 4}
    r = await http.post(CHAT, json=body)
    assert r.status_code in (400, 413), r.text
    return r.status_code


BEHAVIOURS = [disconnect_mid_stream, garbage, abandoned_session, huge_stops, huge_prompt]


FIVE_XX: list[str] = []


async def crowd_and_polite(url):
    statuses: dict[int, int] = {}
    polite_ok = polite_total = 0
    headers = {"Authorization": f"Bearer {KEY}"}
    limits = httpx.Limits(max_connections=CLIENTS + 10)

    async def keep_5xx(r):  # what a 5xx said, for the assertion's message
        if r.status_code >= 500 and len(FIVE_XX) < 5:
            await r.aread()
            FIVE_XX.append(f"{r.request.method} {r.request.url.path} {r.status_code}: "
                           f"{r.text[:300]}")

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits,
                                 event_hooks={"response": [keep_5xx]}) as http:
        async def hostile(i):
            rng = random.Random(i)
            for _ in range(3):
                code = await rng.choice(BEHAVIOURS)(http, rng)
                statuses[code] = statuses.get(code, 0) + 1

        async def polite():
            nonlocal polite_ok, polite_total
            for _ in range(6):
                r = await http.post(CHAT, json={"messages": ask("A code."), "max_tokens": 8,
                                                "guided_regex": "[A-Z]{3}-[0-9]{2}"})
                polite_total += 1
                if r.status_code == 200 and re.fullmatch(
                        "[A-Z]{3}-[0-9]{2}", r.json()["choices"][0]["message"]["content"]):
                    polite_ok += 1
                assert (await http.get("/health")).status_code == 200

        await asyncio.wait_for(asyncio.gather(polite(), *(hostile(i) for i in range(CLIENTS))),
                               timeout=600)
    return statuses, polite_ok, polite_total


def test_a_client_that_hangs_up_first_takes_no_one_else_with_it(svc):
    """The first request to a worker opens the front end's channel to it; its client hangs
    up (Serve cancels the request) while another stream on the same channel goes on: that
    stream still ends with its whole answer (the channel's call was once the first
    request's child, cancelled with it: a 500 for every request on it). Runs first in this
    module, on a fresh service."""
    async def both():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=svc.url, headers=headers, timeout=120) as http:
            body = {"messages": ask("Letters."), "stream": True, "max_tokens": 120,
                    "guided_regex": "[a-z]{120}"}

            async def hang_up():
                async with http.stream("POST", CHAT, json=body) as r:
                    async for _ in r.aiter_lines():
                        break

            async def stay():
                await asyncio.sleep(0.05)  # the channel is the first one's
                text, done = "", False
                async with http.stream("POST", CHAT, json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            event = json.loads(line[6:])
                            assert "error" not in event, event
                            text += event["choices"][0]["delta"].get("content") or ""
                return text, done

            _, (text, done) = await asyncio.gather(hang_up(), stay())
            return text, done

    text, done = asyncio.run(both())
    assert done and re.fullmatch("[a-z]{120}", text), text


def test_hostile_crowd(svc):
    statuses, ok, total = asyncio.run(crowd_and_polite(svc.url))
    print(f"\nhostile crowd: {CLIENTS} clients, statuses {dict(sorted(statuses.items()))}, "
          f"polite {ok}/{total}")
    assert not [s for s in statuses if s >= 500], (statuses, FIVE_XX)
    assert ok == total
    assert httpx.get(svc.url + "/health", timeout=30).status_code == 200
    worker = launch.handles()["workers"][0]
    deadline = time.monotonic() + 60
    while True:  # abandoned sessions end after the 5 s idle timeout
        load = ray.get(worker.load.remote())
        if (load["running"] == load["waiting"] == load["live_processors"] == 0
                and load["live_sessions"] == 0 and load["free_blocks"] == load["total_blocks"]):
            break
        assert time.monotonic() < deadline, f"the worker did not return to zero: {load}"
        time.sleep(0.5)
