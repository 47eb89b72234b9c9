"""Bringing the runtime up on Ray, finding it, and taking it down.

up(): the grammar-cache actor, the scheduler and N worker actors (spread across nodes,
one GPU each on a GPU cluster), all named in the "rayguide" namespace so any process of
the cluster finds them; detached when the runtime runs as a service (``rayguide up``), so
it outlives the process that started it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time

import ray

from cluster.config import ClusterConfig
from grammar_cache.actor import ACTOR_NAME as CACHE_NAME
from grammar_cache.actor import GrammarCacheConfig, get_or_create_actor
from scheduler.actor import (NAMESPACE, SCHEDULER_NAME, WORKER_PREFIX, SchedulerConfig,
                             get_or_create_scheduler)
from worker.actor import WorkerActor

logger = logging.getLogger(__name__)


def connect(address: str | None = None, *, start_head: bool = False) -> None:
    """Joins an existing cluster (``"auto"``, ``"ray://..."``); with no address, starts a
    Ray instance: inside this process, or (``start_head``, for a runtime that must outlive
    this process) a local head node with ``ray start --head``, unless one is running."""
    if ray.is_initialized():
        return
    kwargs = dict(namespace=NAMESPACE, log_to_driver=False)
    if address is None and start_head:
        try:
            ray.init(address="auto", **kwargs)
            return
        except ConnectionError:
            subprocess.run([ray_executable(), "start", "--head", "--disable-usage-stats"],
                           check=True, capture_output=True, timeout=120)
            address = "auto"
    if address is None:  # a new instance, even when `ray start` runs one on this machine
        kwargs["include_dashboard"] = False
        address = "local"
    ray.init(address=address, **kwargs)


def ray_executable() -> str:
    """The `ray` command of this environment (a virtualenv's bin/ need not be on PATH)."""
    local = os.path.join(os.path.dirname(sys.executable), "ray")
    return local if os.path.exists(local) else "ray"


def up(config: ClusterConfig, *, detached: bool = False, wait: bool = True) -> dict:
    """Starts (or finds) every component; returns their handles. Keep them: actors that are
    not detached end when the last handle to them goes away."""
    connect(config.address, start_head=detached)
    lifetime = "detached" if detached else None
    cache = get_or_create_actor(GrammarCacheConfig(**config.grammar_cache), detached=detached,
                                resources=config.control_resources)
    scheduler = get_or_create_scheduler(SchedulerConfig(**config.scheduler), detached=detached,
                                        resources=config.control_resources)
    engine = dataclasses.asdict(config.engine_config())
    # workers compile through the cache actor with the cluster's compile limits (their
    # fallback compiles too)
    cache_link = (CACHE_NAME, NAMESPACE, dict(config.grammar_cache))
    workers = []
    for i in range(config.num_workers):
        workers.append(WorkerActor.options(
            name=f"{WORKER_PREFIX}{i}", namespace=NAMESPACE, get_if_exists=True,
            lifetime=lifetime, scheduling_strategy="SPREAD",
            num_cpus=config.worker.num_cpus, num_gpus=config.worker.num_gpus,
        ).remote(engine, f"w{i}", (SCHEDULER_NAME, NAMESPACE), cache_link))
    if wait:
        ray.get([w.health.remote() for w in workers])
        ray.get(cache.ping.remote())
        _wait_registered(scheduler, config.num_workers)
    return {"cache": cache, "scheduler": scheduler, "workers": workers}


def _wait_registered(scheduler, n: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(ray.get(scheduler.stats.remote())["workers"]) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {n} workers registered with the scheduler")
        time.sleep(0.2)


def handles() -> dict:
    """The running runtime's actors (raises ValueError naming what is missing)."""
    try:
        scheduler = ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
        cache = ray.get_actor(CACHE_NAME, namespace=NAMESPACE)
    except ValueError:
        raise ValueError("no rayguide runtime on this cluster; start one with `rayguide up`") \
            from None
    workers = [ray.get_actor(a["name"], namespace=NAMESPACE)
               for a in ray.util.list_named_actors(all_namespaces=True)
               if a["namespace"] == NAMESPACE and a["name"].startswith(WORKER_PREFIX)]
    return {"cache": cache, "scheduler": scheduler, "workers": workers}


def status() -> dict:
    """Each worker's node, device, load, and the cache and scheduler stats."""
    h = handles()
    return {"scheduler": ray.get(h["scheduler"].stats.remote()),
            "grammar_cache": ray.get(h["cache"].stats.remote()),
            "workers": ray.get([w.load.remote() for w in h["workers"]])}


def down() -> int:
    """Kills every rayguide actor; returns how many."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE]
    for name in names:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    return len(names)


def status_table(st: dict) -> str:
    rows = ["worker  node          device  running  waiting  free/total KV  sessions  matchers"]
    for w in sorted(st["workers"], key=lambda w: w["worker_id"]):
        rows.append(f"{w['worker_id']:<7} {w['node_id'][:12]:<13} {w['device']:<7} "
                    f"{w['running']:>7}  {w['waiting']:>7}  "
                    f"{w['free_blocks']:>6}/{w['total_blocks']:<6} {w['live_sessions']:>8}  "
                    f"{w['live_processors']:>8}")
    c = st["grammar_cache"]
    rows.append(f"grammar cache: {c['compiles']} compiles, {c['hits']} hits, "
                f"{c['errors']} errors, {c['timeouts']} timeouts, {c['bytes'] / 1e6:.1f} MB")
    s = st["scheduler"]
    rows.append(f"scheduler: {len(s['workers'])} workers, {s['sessions']} sessions, "
                f"{s['routes']} routes, {s['broadcast_messages']} broadcast messages")
    return "\n".join(rows)
