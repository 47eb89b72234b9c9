"""The whole service in one process's hands: the runtime (grammar cache, scheduler, workers)
plus the OpenAI endpoint on Ray Serve. ``rayguide serve`` and the tests use it.

With no address it starts a Ray instance inside this process, so everything ends with the
process. On an existing cluster (``address="auto"``) it reuses a runtime that is already up
(``rayguide up``) and leaves it running on stop; what it started itself it takes down.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import ray
from ray import serve

from cluster import launch
from cluster.config import ClusterConfig
from deploy.serve_app import build_app

APP_NAME = "rayguide"


@dataclass
class Service:
    url: str
    started_ray: bool
    started_runtime: bool
    api_key: str | None = None
    # the handles of the actors this process started: a non-detached actor lives while a
    # handle to it does, so the Service must hold them
    runtime: dict | None = None

    def curl_example(self) -> str:
        auth = f" \\\n  -H 'Authorization: Bearer {self.api_key}'" if self.api_key else ""
        body = ('{"messages": [{"role": "user", "content": "Name a planet."}], '
                '"response_format": {"type": "json_schema", "json_schema": {"name": "p", '
                '"schema": {"type": "object", "properties": {"planet": {"type": "string"}}, '
                '"required": ["planet"]}}}}')
        return (f"curl {self.url}/v1/chat/completions -H 'Content-Type: application/json'"
                f"{auth} \\\n  -d '{body}'")


def start(config: ClusterConfig, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, num_replicas: int = 1, app_args: dict | None = None
          ) -> Service:
    started_ray = not ray.is_initialized() and config.address is None
    if started_ray:
        need = config.num_workers * config.worker.num_cpus + 1
        # "local": a new instance even when `ray start` runs a cluster on this machine
        ray.init(address="local", namespace=launch.NAMESPACE, include_dashboard=False,
                 log_to_driver=False,
                 num_cpus=max(os.cpu_count() or 1, int(need + 0.999)))
    else:
        launch.connect(config.address)
    try:
        runtime = launch.handles()
        started_runtime = False
    except ValueError:
        runtime = launch.up(config)
        started_runtime = True
    # one HTTP proxy, on this (head) node: the address printed is the address served
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    args = {"api_key": api_key, "num_replicas": num_replicas, "start_runtime": False,
            **(app_args or {})}
    serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
    _wait_ready(APP_NAME)
    return Service(f"http://{host}:{port}", started_ray, started_runtime, api_key, runtime)


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
        time.sleep(0.5)


def stop(service: Service) -> None:
    """Takes down what ``start`` brought up, in reverse order."""
    if service.started_ray:
        serve.shutdown()
        ray.shutdown()
        return
    serve.delete(APP_NAME)
    if service.started_runtime:
        launch.down()

