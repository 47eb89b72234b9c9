"""The runtime a job runs on (the batch job, deploy/batch_job.py): the cluster's running
runtime (``rayguide up``), or, when none is running, one the job starts for its length.

A runtime a job starts is not detached: Ray ends its actors with the job. A second job
that found it would lose it when the first ends, and its own ``launch.up`` would take over
the first job's actors by name. So a job that starts a runtime first creates a named actor
(``RUNTIME_CLAIM``; creating a name that exists fails: a cluster-wide claim, released by
Ray when the job dies); a job that finds the claim waits for that job's runtime to go away
and then starts its own. Jobs never share (or kill) each other's runtime; for several jobs
at once, run ``rayguide up`` first.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Callable

import ray

from cluster import launch
from cluster.config import ClusterConfig
from scheduler.actor import NAMESPACE

RUNTIME_CLAIM = "rayguide_batch_job_runtime"


def connect(address: str | None) -> None:
    """This driver to ``address``; None: the Ray job's cluster (RAY_ADDRESS) or a running
    local one, else a Ray instance in this process."""
    if address is not None:
        launch.connect(address)
        return
    try:
        launch.connect("auto")
    except ConnectionError:
        launch.connect(None)


def _claim_class():
    @ray.remote(num_cpus=0)
    class BatchJobRuntimeClaim:
        def __init__(self, owner: str):
            self.owner = owner

        def who(self) -> str:
            return self.owner

    return BatchJobRuntimeClaim


def runtime_claim_owner() -> str | None:
    """Who holds the claim (another job's own runtime is on the cluster), or None."""
    try:
        return ray.get(ray.get_actor(RUNTIME_CLAIM, namespace=NAMESPACE).who.remote(),
                       timeout=30)
    except ValueError:
        return None  # no claim
    except Exception:  # noqa: BLE001 - it died between the lookup and the call
        return None


def claim_runtime(owner: str) -> bool:
    """Takes the claim for a runtime this job starts; False when another job holds it."""
    try:
        claim = _claim_class().options(name=RUNTIME_CLAIM, namespace=NAMESPACE).remote(owner)
    except ValueError:  # the name is taken
        return False
    try:
        if ray.get(claim.who.remote(), timeout=60) != owner:
            return False
    except Exception:  # noqa: BLE001 - killed as it started (`rayguide down`): try again
        return False
    _held_claim.append(claim)  # a named actor lives while a handle to it does
    return True


_held_claim: list = []


def job_label() -> str:
    """This job as the claim names it to a job that waits: Ray's job id, pid and host."""
    return f"{ray.get_runtime_context().get_job_id()} (pid {os.getpid()} on " \
           f"{socket.gethostname()})"


def _names() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE}


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def acquire_runtime(make_config: Callable[[], ClusterConfig], *, label: str,
                    poll_s: float = 5.0, say: Callable[[str], None] = _stderr,
                    claim_owner: Callable[[], str | None] = runtime_claim_owner,
                    take_claim: Callable[[str], bool] = claim_runtime
                    ) -> tuple[dict, list[str]]:
    """(handles, names of the actors this job started, its claim last) on the connected
    cluster: the running runtime (nothing started) unless another job claimed it (then
    this job waits for it to end) or none is running; then one from ``make_config()``,
    claimed as ``label``. ``say`` tells the user what happens; ``claim_owner`` and
    ``take_claim`` read and take the claim."""
    told = False
    while True:
        owner = claim_owner()
        if owner is not None:  # another job's runtime: it ends with that job
            if not told:
                say(f"the runtime on this cluster belongs to batch job {owner} and ends "
                    "with it; waiting for it to end (run `rayguide up` for a runtime "
                    "several jobs share)")
                told = True
            time.sleep(poll_s)
            continue
        try:
            handles = launch.handles()
            if not handles["workers"]:
                raise ValueError("the rayguide runtime on this cluster has no workers")
        except ValueError as exc:
            if claim_owner() is not None:
                continue  # another job is starting its runtime
            if "no rayguide runtime" not in str(exc):
                raise
        else:
            if claim_owner() is not None:
                continue  # found as another job started it
            return handles, []
        if take_claim(label):
            break
    before = _names() | {RUNTIME_CLAIM}
    try:
        config = make_config()
        say(f"no runtime running; starting one ({config.num_workers} workers, model "
            f"{config.model or 'default'})")
        started = time.monotonic()
        handles = launch.up(config)
    except BaseException:
        release_runtime(sorted(_names() - before) + [RUNTIME_CLAIM])
        raise
    owned = sorted(_names() - before)
    say(f"runtime up in {time.monotonic() - started:.1f} s")
    return handles, owned + [RUNTIME_CLAIM]


def release_runtime(owned: list[str], timeout_s: float = 30.0) -> None:
    """Kills the actors this job started, the claim last, once the others are gone (a
    job waiting for the claim must not find this runtime half dead)."""
    def kill(name: str) -> None:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    runtime = [n for n in owned if n != RUNTIME_CLAIM]
    for name in runtime:
        kill(name)
    deadline = time.monotonic() + timeout_s
    while runtime and time.monotonic() < deadline:
        if not _names() & set(runtime):
            break
        time.sleep(0.2)
    if RUNTIME_CLAIM in owned:
        kill(RUNTIME_CLAIM)
        _held_claim.clear()
