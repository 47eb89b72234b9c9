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
from deploy.settings import AppSettings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
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
    assert config.worker.num_gpus == 1 and config.engine.device == "cuda"
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

    from core.errors import NoWorkers, Overloaded
    from deploy.errors import for_exception, for_kind
    assert for_exception(Overloaded("all queues full")).status == 429
    assert for_exception(NoWorkers("none")).status == 503
    # a full compile queue is a 429, a compile service failure a 503
    from core.errors import ErrorKind, GrammarUnavailable
    assert for_exception(GrammarUnavailable("queue full", ErrorKind.OVERLOADED)).status == 429
    assert for_exception(GrammarUnavailable("crashed")).status == 503
    assert for_exception(ValueError("max_new_tokens must be >= 1")).status == 400
    assert for_exception(RuntimeError("boom"), "r1").status == 500  # a bug in our code
    assert "r1" in for_exception(RuntimeError("boom"), "r1").message
    with pytest.raises(asyncio.CancelledError):
        for_exception(asyncio.CancelledError())
    assert for_kind("invalid_grammar", "bad").status == 400
    assert for_kind("grammar_unavailable", "slow").status == 503
    assert for_kind("worker_died", "gone").status == 503


def _containers(cluster: dict):
    groups = [cluster["headGroupSpec"]] + cluster.get("workerGroupSpecs", [])
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


@pytest.mark.parametrize("name,key", [("rayservice.yaml", "rayClusterConfig"),
                                      ("rayjob.yaml", "rayClusterSpec")])
def test_manifests_secure_by_default(name, key):
    """Ray token auth on; the dashboard not bound to every interface by us and not put on
    an external service (KubeRay's head service is ClusterIP); no Ray client port."""
    doc = yaml.safe_load((K8S / name).read_text())
    cluster = doc["spec"][key]
    assert cluster.get("authOptions") == {"mode": "token"}
    for group in [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]:
        assert "dashboard-host" not in group.get("rayStartParams", {})
    assert cluster["headGroupSpec"].get("headService", {}).get("spec", {}).get(
        "type", "ClusterIP") == "ClusterIP"
    for c in _containers(cluster):
        assert 10001 not in [p["containerPort"] for p in c.get("ports", [])]


def test_rayservice_requires_the_api_key():
    """Every container that reads the API key gets it from the secret, which is required:
    without the secret the pods do not start, rather than serving without auth."""
    doc = yaml.safe_load((K8S / "rayservice.yaml").read_text())
    refs = [e["valueFrom"]["secretKeyRef"] for c in _containers(doc["spec"]["rayClusterConfig"])
            for e in c.get("env", []) if e["name"] == "RAYGUIDE_API_KEY"]
    assert len(refs) == 2  # head (where the replicas run) and GPU workers
    for ref in refs:
        assert ref["name"] == "rayguide" and ref["key"] == "api-key"
        assert ref.get("optional", False) is False


CLUSTERS = [("rayservice.yaml", "rayClusterConfig", "serve"),
            ("rayjob.yaml", "rayClusterSpec", "batch")]
CLUSTER_LABEL = "rayguide.io/cluster"


def _pod_templates(cluster: dict):
    return [g["template"] for g in [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]]


def _policies() -> dict:
    docs = [d for d in yaml.safe_load_all((K8S / "networkpolicy.yaml").read_text()) if d]
    assert all(d["kind"] == "NetworkPolicy" for d in docs)
    return {d["spec"]["podSelector"]["matchLabels"][CLUSTER_LABEL]: d for d in docs}


def test_network_policy_keeps_ray_ports_inside():
    for doc in _policies().values():
        assert doc["spec"]["policyTypes"] == ["Ingress"]
        rules = doc["spec"]["ingress"]
        open_ports = {p["port"] for r in rules if "ports" in r for p in r["ports"]}
        assert open_ports <= {8265, 8000} and 8265 in open_ports
        (dash,) = [r for r in rules if "ports" in r and r["ports"][0]["port"] == 8265]
        assert "namespaceSelector" in dash["from"][0]  # the KubeRay operator's namespace only
    assert 8000 not in {p["port"] for r in _policies()["batch"]["spec"]["ingress"]
                        for p in r.get("ports", [])}  # the batch cluster serves no endpoint


@pytest.mark.parametrize("name,key,label", CLUSTERS)
def test_network_policy_admits_only_its_own_cluster(name, key, label):
    """Every pod of a cluster carries its label; its policy selects those pods, and the
    rule that admits every port admits only pods with the same label (not every Ray
    cluster of the namespace, as ``ray.io/cluster: Exists`` did)."""
    cluster = yaml.safe_load((K8S / name).read_text())["spec"][key]
    for template in _pod_templates(cluster):
        assert template["metadata"]["labels"][CLUSTER_LABEL] == label
    policy = _policies()[label]
    assert policy["spec"]["podSelector"] == {"matchLabels": {CLUSTER_LABEL: label}}
    for rule in policy["spec"]["ingress"]:
        if "ports" not in rule:  # every port: this cluster's pods only
            (peer,) = rule["from"]
            assert peer == {"podSelector": {"matchLabels": {CLUSTER_LABEL: label}}}


@pytest.mark.parametrize("name,key,label", CLUSTERS)
def test_pods_run_unprivileged(name, key, label):
    """Non-root, no privilege escalation, no capabilities, a read-only root filesystem,
    and a writable emptyDir wherever Ray and rayguide write (/tmp, /cache)."""
    cluster = yaml.safe_load((K8S / name).read_text())["spec"][key]
    for template in _pod_templates(cluster):
        pod = template["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        for c in template["spec"]["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
            assert "emptyDir" in mounts["/tmp"] and "emptyDir" in mounts["/cache"]
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["RAYGUIDE_CACHE_DIR"].startswith("/cache/")
            assert env["XDG_CACHE_HOME"] == "/cache"


def test_hub_models_are_pinned():
    """A hub model in a manifest names its commit: every pod downloads the same weights."""
    import re
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        for line in path.read_text().splitlines():
            found += re.findall(r"hf:[^\s\"']+", line.partition("#")[0])  # not comments
    assert found
    for ref in found:
        assert re.fullmatch(r"hf:[\w.-]+/[\w.-]+@[0-9a-f]{40}", ref), ref


def test_local_serve_config_binds_loopback():
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
