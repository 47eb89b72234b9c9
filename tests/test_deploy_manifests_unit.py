"""The deployment files parse and point at real things: the Serve config and the KubeRay
RayService name importable app builders whose args our settings accept, the RayJob's
entrypoint is a command line the batch job accepts, and the GPU layout is one worker actor
per GPU."""

import importlib
import shlex
from pathlib import Path

import pytest
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.config import ClusterConfig
from deploy import batch_job
from deploy.serve_app import AppSettings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
IMAGE_ROOT = "/home/ray/rayguide/"  # where the Dockerfile puts the repository


def check_serve_config(config: dict) -> list[AppSettings]:
    ServeDeploySchema.model_validate(config)  # Serve's own schema for config files
    settings = []
    for app in config["applications"]:
        module, attr = app["import_path"].split(":")
        builder = getattr(importlib.import_module(module), attr)
        assert callable(builder)
        s = AppSettings.from_args(app.get("args", {}))  # unknown keys raise, naming them
        s.cluster_config()
        settings.append(s)
        builder(app.get("args", {}))  # the application builds
    return settings


def test_serve_config_file():
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    (s,) = check_serve_config(config)
    assert s.cluster_config().num_workers == 2


def test_rayservice_manifest():
    doc = yaml.safe_load((K8S / "rayservice.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    (s,) = check_serve_config(yaml.safe_load(doc["spec"]["serveConfigV2"]))
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    (group,) = cluster["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    config = s.cluster_config()
    assert config.worker.num_gpus == 1 and config.engine_config().device == "cuda"
    assert config.num_workers == group["replicas"]  # one worker actor per GPU pod


def test_rayjob_manifest():
    doc = yaml.safe_load((K8S / "rayjob.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob"
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "deploy.batch_job"]
    args = batch_job.parse_args(argv[3:])
    assert args.input.startswith("/data/") and args.output.startswith("/data/")
    assert args.config.startswith(IMAGE_ROOT)
    config = ClusterConfig.from_yaml(ROOT / args.config[len(IMAGE_ROOT):],
                                     num_workers=args.workers, model=args.model)
    cluster = doc["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    (group,) = cluster["workerGroupSpecs"]
    assert config.worker.num_gpus == 1 and config.num_workers == group["replicas"]


def test_dockerfile_matches_ray_version_and_paths():
    text = (K8S / "Dockerfile").read_text()
    assert f"rayproject/ray:{ray.__version__}-" in text
    assert f"WORKDIR {IMAGE_ROOT.rstrip('/')}" in text


def test_app_settings_reject_unknown_keys():
    with pytest.raises(ValueError, match="num_worker"):
        AppSettings.from_args({"num_worker": 2})
    with pytest.raises(ValueError, match="kv_cache_gbs"):
        AppSettings.from_args({"engine": {"kv_cache_gbs": 1}})
    s = AppSettings.from_args({"num_replicas": "3", "start_runtime": "false"})
    assert s.num_replicas == 3 and s.start_runtime is False


def test_runtime_errors_map_to_statuses():
    """What the ingress answers when the runtime refuses or fails (no Ray needed)."""
    import asyncio

    from deploy.serve_app import _api_error, _chunk_error
    from scheduler.routing import NoWorkers, Overloaded
    assert _api_error(Overloaded("all queues full")).status == 429
    assert _api_error(NoWorkers("none")).status == 503
    assert _api_error(ValueError("max_new_tokens must be >= 1")).status == 400
    assert _api_error(RuntimeError("boom")).status == 503
    with pytest.raises(asyncio.CancelledError):
        _api_error(asyncio.CancelledError())
    assert _chunk_error({"error": "bad", "error_kind": "grammar"}).status == 400
    assert _chunk_error({"error": "slow", "error_kind": "grammar_wait"}).status == 503
    assert _chunk_error({"error": "gone", "error_kind": "worker_died"}).status == 503
