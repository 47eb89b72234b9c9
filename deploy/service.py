"""The whole service in one process's hands: the runtime (grammar cache, scheduler, workers)
plus the OpenAI endpoint on Ray Serve. ``rayguide serve`` and the tests use it.

With no address it starts a Ray instance inside this process, so everything ends with the
process. On an existing cluster (``address="auto"``) it reuses a runtime that is already up
(``rayguide up``) and leaves it running on stop; what it started itself it takes down.

Self-healing: ``heal`` (called every few seconds by ``rayguide serve``) rebuilds any
component of a runtime this process started that died for good (killed with no restart,
or out of restarts) and, when the scheduler was replaced, redeploys the app so the front
ends reach the new one; what it cannot rebuild it reports as ``RuntimeLost``, and
``rayguide serve`` then exits non-zero so a supervisor restarts it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import ray
from ray import serve

from cluster import launch
from cluster.config import ClusterConfig
# what takes HTTP on an instance this starts (cluster/ingress.py: `rayguide up` makes the
# same choice for its head); the names are this module's too
from cluster.ingress import (HAPROXY_ENV, LOOPBACK_SHIM, choose_ingress,  # noqa: F401
                             haproxy_binary, ingress_environment, remove_workdir, workdir_of)
from deploy import exposure, tenants
from deploy.serve_app import build_app

APP_NAME = "rayguide"

logger = logging.getLogger(__name__)


class RuntimeLost(RuntimeError):
    """The runtime behind the endpoint is gone and this process cannot rebuild it."""


def _stderr_progress(message: str) -> None:
    print(f"rayguide: {message}", file=sys.stderr, flush=True)


@dataclass
class Service:
    url: str
    started_ray: bool
    started_runtime: bool
    api_key: str | None = None
    # the handles of the actors this process started: a non-detached actor lives while a
    # handle to it does, so the Service must hold them
    runtime: dict | None = None
    config: ClusterConfig | None = None
    app_args: dict = field(default_factory=dict)
    stages: dict = field(default_factory=dict)  # stage -> seconds, in start order
    rebuilds: int = 0
    keys_file: str | None = None  # deploy/tenants.py: one key per tenant
    ingress: str | None = None  # "haproxy" / "proxy"; None: the cluster's, not chosen here
    ingress_dir: str | None = None  # HAProxy's files for this instance, removed on stop

    def curl_example(self) -> str:
        key = self.api_key or ("<your key from the keys file>" if self.keys_file else None)
        auth = f" \\\n  -H 'Authorization: Bearer {key}'" if key else ""
        body = ('{"messages": [{"role": "user", "content": "Name a planet."}], '
                '"response_format": {"type": "json_schema", "json_schema": {"name": "p", '
                '"schema": {"type": "object", "properties": {"planet": {"type": "string"}}, '
                '"required": ["planet"]}}}}')
        return (f"curl {self.url}/v1/chat/completions -H 'Content-Type: application/json'"
                f"{auth} \\\n  -d '{body}'")


class _Stages:
    """Times each start stage and reports it as one line (``progress``)."""

    def __init__(self, progress: Callable[[str], None] | None):
        self.progress = progress
        self.times: dict[str, float] = {}
        self.t0 = time.monotonic()
        self._last = self.t0

    def done(self, name: str, what: str) -> None:
        now = time.monotonic()
        self.times[name] = round(now - self._last, 3)
        self._last = now
        if self.progress:
            self.progress(f"{what} ({self.times[name]:.1f} s)")


@contextlib.contextmanager
def ingress_env(env: dict[str, str], environ=os.environ):
    """``env`` set while Ray starts: its processes (the Serve controller, HAProxy's manager,
    replicas) inherit the environment of the raylet ``ray.init`` starts and read these
    when they start. This process's own is restored after, so nothing it starts later
    inherits them."""
    before = {k: environ.get(k) for k in env}
    environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                environ.pop(k, None)
            else:
                environ[k] = v


def start(config: ClusterConfig, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, num_replicas: int = 1, app_args: dict | None = None,
          allow_open: bool = False, keys_file: str | None = None,
          progress: Callable[[str], None] | None = None, ingress: str | None = None
          ) -> Service:
    """Starts Ray (unless connected), the runtime (unless one runs), Serve's HTTP ingress and
    the app, in that order; ``progress`` gets one line per stage with its time. ``ingress``
    (default ``config.serve.ingress``) picks what takes HTTP on a Ray instance this starts:
    "haproxy" (HAProxy in front of replicas that serve HTTP themselves) or "proxy" (Serve's
    Python proxy actor); on a cluster it connects to, the cluster's setting holds. A
    non-loopback ``host`` needs an ``api_key``, a ``keys_file`` (deploy/tenants.py: one key
    per tenant) or ``allow_open`` (ValueError before anything starts: deploy/exposure.py
    open_refusal); a keys file that cannot be read is a ValueError naming its line, also
    before anything starts."""
    if keys_file:
        tenants.key_table(api_key, tenants.read_keys_file(keys_file))
    refusal = exposure.open_refusal(host, api_key or keys_file, allow_open)
    if refusal is not None:
        raise ValueError(refusal)
    stages = _Stages(progress)
    started_ray = not ray.is_initialized() and config.address is None
    chosen = None  # a cluster's own (RAY_SERVE_ENABLE_HA_PROXY where its head started)
    env: dict[str, str] = {}
    if started_ray:
        chosen = choose_ingress(ingress or config.serve.ingress)
        env = ingress_environment(chosen)
        need = config.num_workers * config.worker.num_cpus + 1
        launch.fast_death_notice()
        # Token auth on, said explicitly: Ray turns it on for a new local instance anyway,
        # but warns that it did when RAY_AUTH_MODE is unset. A user's own setting wins.
        if "RAY_AUTH_MODE" not in os.environ:
            launch.set_auth_mode("token")
        # "local": a new instance even when `ray start` runs a cluster on this machine;
        # no dashboard and no Prometheus exporter (it would answer anyone on 0.0.0.0)
        try:
            with ingress_env(env):
                ray.init(address="local", namespace=launch.NAMESPACE, log_to_driver=False,
                         num_cpus=max(os.cpu_count() or 1, int(need + 0.999)),
                         **launch.private_instance_options())
        except BaseException:
            remove_workdir(workdir_of(env))
            raise
    else:
        launch.connect(config.address)
    gcs = ray.get_runtime_context().gcs_address
    stages.done("ray", f"Ray ready at {gcs}" + (
        " (a private instance in this process, token auth on; `rayguide status --address "
        f"{gcs}` shows it)" if started_ray else ""))
    try:
        runtime = launch.handles()
    except ValueError:  # none yet (outside the except: its errors are not "during" this)
        runtime = None
    started_runtime = runtime is None
    if started_runtime:
        # the runtime's actors are created now and load while Serve starts beside them
        # (the front end needs only their names; /health answers 200 once a worker has
        # registered), so /health is ready sooner than if they started one after the other
        runtime = launch.up(config, wait=False)
    else:
        stages.done("runtime", "using the rayguide runtime already on this cluster")
    # one HTTP ingress, on this (head) node: the address printed is the address served
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    front = {"haproxy": "HAProxy", "proxy": "HTTP proxy"}.get(chosen, "HTTP ingress")
    stages.done("serve_controller", f"Serve controller and {front} on {host}:{port}")
    args = {"api_key": api_key, "num_replicas": num_replicas, "start_runtime": False,
            **({"allow_open": True} if allow_open else {}),
            **({"keys_file": keys_file} if keys_file else {}), **(app_args or {})}
    _deploy(args)
    stages.done("app", f"app ready ({num_replicas} front-end replica(s))")
    if started_runtime:
        _wait_runtime(config, runtime, stages)
    return Service(f"http://{host}:{port}", started_ray, started_runtime, api_key, runtime,
                   config, args, stages.times, keys_file=args.get("keys_file"),
                   ingress=chosen,
                   ingress_dir=workdir_of(env))


def _wait_runtime(config: ClusterConfig, runtime: dict, stages: _Stages) -> None:
    """Waits for what ``launch.up(wait=False)`` created, each wait reported on its own: the
    actors load in parallel, so each stage's time is how much longer it took than the
    last."""
    launch.wait_cache_ready(runtime["cache"])
    stages.done("grammar_cache", "grammar cache ready (its compile processes are up)")
    ray.get([w.health.remote() for w in runtime["workers"]])
    stages.done("workers", f"{len(runtime['workers'])} worker(s) loaded the model "
                f"({config.model or 'the default model'})")
    launch._wait_registered(runtime["scheduler"], config.num_workers)
    stages.done("scheduler", "workers registered with the scheduler")


def _deploy(args: dict) -> None:
    """Deploys the app on the Serve instance ``start`` just started. ``serve.run`` would call
    ``serve.start`` again, which only logs that the controller exists and that "new
    http_options will not be applied" (alarming, and untrue here: they were applied a moment
    ago), so the app is built and deployed the way ``serve.run`` does, through the client
    ``serve.start`` left. Falls back to ``serve.run`` if Ray's internals moved."""
    app = build_app(args)
    try:
        from ray.serve._private.build_app import build_app as build_serve_app
        from ray.serve.context import _get_global_client

        client = _get_global_client()
        built = build_serve_app(app, name=APP_NAME, route_prefix="/",
                                default_runtime_env=ray.get_runtime_context().runtime_env)
        client.deploy_applications([built], wait_for_applications_running=False)
    except (ImportError, AttributeError, TypeError):
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    _wait_ready(APP_NAME)


def _wait_ready(name: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(name)
        state = str(getattr(status, "status", ""))
        if state.endswith("RUNNING"):
            return
        if state.endswith("DEPLOY_FAILED") or time.monotonic() > deadline:
            raise RuntimeError(f"the Serve app did not start ({state}): "
                               f"{getattr(status, 'message', '')}")
        time.sleep(0.2)


def missing_components(service: Service) -> list[str]:
    """The runtime's named actors that are gone for good. A dead actor's name is released
    only when Ray will not restart it (killed with ``no_restart``, or out of restarts); one
    that is restarting keeps its name and is not missing."""
    config = service.config
    names = [launch.CACHE_NAME, launch.SCHEDULER_NAME] + [
        f"{launch.WORKER_PREFIX}{i}" for i in range(config.num_workers if config else 0)]
    missing = []
    for name in names:
        try:
            ray.get_actor(name, namespace=launch.NAMESPACE)
        except ValueError:
            missing.append(name)
    return missing


def heal(service: Service, progress: Callable[[str], None] | None = _stderr_progress
         ) -> list[str]:
    """Rebuilds what died for good; returns what was rebuilt (empty: all was well). Raises
    RuntimeLost when it cannot: Ray itself is gone, or the runtime is not this process's
    (``rayguide up`` owns it), or the rebuild fails."""
    try:
        missing = missing_components(service)
    except Exception as exc:  # the GCS is gone: nothing left to rebuild on
        raise RuntimeLost(f"lost the Ray instance ({type(exc).__name__}: {exc})") from exc
    if not missing:
        return []
    if not service.started_runtime:
        raise RuntimeLost(f"{', '.join(missing)} died and this process did not start the "
                          "runtime; start it again with `rayguide up`")
    if progress:
        progress(f"{', '.join(missing)} died for good (killed, or out of restarts); "
                 "rebuilding")
    t0 = time.monotonic()
    try:
        service.runtime = _keep_live_handles(service.runtime, launch.up(service.config),
                                             missing)
        if launch.SCHEDULER_NAME in missing:
            _replace_front_ends(service)
    except Exception as exc:
        raise RuntimeLost(f"could not rebuild {', '.join(missing)}: "
                          f"{type(exc).__name__}: {exc}") from exc
    service.rebuilds += 1
    if progress:
        progress(f"rebuilt {', '.join(missing)} in {time.monotonic() - t0:.1f} s")
    return missing


def _replace_front_ends(service: Service) -> None:
    """The front ends hold the old scheduler's handle, which stays dead: they are
    replaced by redeploying the app with a new ``runtime_generation``. Serve then rolls
    the replicas over, the old ones answering (a 503 at worst) until the new ones are up;
    deleting the app first left the route unknown meanwhile, and Serve's proxy answered
    its plain 404."""
    generation = int(service.app_args.get("runtime_generation", 0)) + 1
    service.app_args = {**service.app_args, "runtime_generation": generation}
    _deploy(service.app_args)


def _keep_live_handles(old: dict | None, new: dict, missing: list[str]) -> dict:
    """The runtime's handles after a rebuild: the original (creating) handle of every actor
    that survived, a new one for each rebuilt actor. The handles ``up`` returns for actors
    that already existed are looked up by name, and such handles do not keep a
    non-detached actor alive: dropping the originals would end the survivors."""
    if not old:
        return new
    out = dict(new)
    if launch.CACHE_NAME not in missing:
        out["cache"] = old["cache"]
    if launch.SCHEDULER_NAME not in missing:
        out["scheduler"] = old["scheduler"]
    out["workers"] = [
        o if f"{launch.WORKER_PREFIX}{i}" not in missing else n
        for i, (o, n) in enumerate(zip(old["workers"], new["workers"]))
    ] + new["workers"][len(old["workers"]):]
    return out


def stop(service: Service) -> None:
    """Takes down what ``start`` brought up, in reverse order: the app first, so Serve drains
    its replicas while the runtime still answers them, then the runtime, then Ray. Serve's
    controller is not asked to shut down on a private instance: its ``graceful_shutdown``
    ends by killing its own actor, which Ray reports as a failed task ("killed by
    ray.kill"); ``ray.shutdown`` ends it with everything else."""
    try:
        serve.delete(APP_NAME)
    except Exception as exc:  # Ray already gone (e.g. the runtime was lost): nothing to drain
        logger.debug("serve.delete failed: %s", exc)
    if service.started_ray:
        service.runtime = None
        ray.shutdown()
        remove_workdir(service.ingress_dir)
        return
    if service.started_runtime:
        launch.down()
