"""Compile starvation (issue 28) through a real cache actor: a cancelled call reaches the
actor and stops a compile nobody waits for (its child is killed), and a full compile queue
answers a new grammar at once with OVERLOADED instead of queueing it. The queue's logic,
fairness and the repetition guard are tested without Ray in test_compile_guard_unit.py."""

import os
import time
import uuid

import pytest
import ray
import xgrammar as xgr

from grammar_cache.actor import GrammarCacheConfig, get_or_create_actor, wait_ready
from grammar_cache.client import GrammarCacheClient
from grammar_cache.compile import tokenizer_fingerprint
from core.errors import ErrorKind, GrammarUnavailable
from core.grammar_spec import GrammarSpec

pytestmark = pytest.mark.integration

VOCAB = ["<eos>", "{", "}", '"', "a", "b", ":", ",", " ", "1", "2", "x", "y", "z", "0", "-"]


def slow(n: int) -> GrammarSpec:
    """Seconds to compile even with a tiny vocabulary: many distinct string bounds."""
    return GrammarSpec.json_schema({
        "type": "object", "required": [f"p{i}" for i in range(600)],
        "properties": {f"p{i}": {"type": "string", "minLength": 100 + i + n,
                                 "maxLength": 3000 + 53 * i} for i in range(600)}})


@pytest.fixture(scope="module")
def ray_local(shared_ray):
    with shared_ray():  # every named actor (the caches these tests start) gone after
        yield


@pytest.fixture
def actor(ray_local):
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[0])
    name = f"gc-{uuid.uuid4().hex[:8]}"
    handle = get_or_create_actor(GrammarCacheConfig(compile_processes=1, max_queued_compiles=1,
                                                    compile_timeout_s=60, disk=False),
                                 name=name)
    wait_ready(handle)
    fp = tokenizer_fingerprint(info)
    ray.get(handle.register_tokenizer.remote(fp, info.serialize_json()))
    yield handle, name, info, fp
    ray.kill(handle)


def busy_pid(handle, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = ray.get(handle.compile_pids.remote())
        if pids:
            return next(iter(pids))
        time.sleep(0.05)
    raise AssertionError("no compile started")


def test_a_cancelled_call_stops_its_compile(actor):
    handle, _, _, fp = actor
    ref = handle.get.remote(slow(0), fp)
    pid = busy_pid(handle)
    ray.cancel(ref)  # what the worker's client does when its call times out
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")  # killed long before its compile would end
    # the child dies before the actor's task has counted the cancellation: wait for it
    stats = ray.get(handle.stats.remote())
    while stats["cancelled"] == 0 and time.monotonic() < deadline + 10:
        time.sleep(0.05)
        stats = ray.get(handle.stats.remote())
    assert stats["cancelled"] == 1 and stats["compiles"] == 0


def test_a_full_queue_answers_overloaded_at_once(actor):
    handle, name, info, fp = actor
    running = handle.get.remote(slow(1), fp)
    busy_pid(handle)
    waiting = handle.get.remote(slow(2), fp)  # the one place in the queue
    time.sleep(0.5)
    client = GrammarCacheClient(info, GrammarCacheConfig(disk=False), name=name)
    try:
        t = time.monotonic()
        with pytest.raises(GrammarUnavailable) as err:
            client.fetch(GrammarSpec.regex("[a-z]+"))
        assert time.monotonic() - t < 5  # not after a compile
        assert err.value.kind is ErrorKind.OVERLOADED
        assert client.stats()["local_fallbacks"] == 0
    finally:
        client.close()
        ray.cancel(waiting)
        ray.cancel(running)
