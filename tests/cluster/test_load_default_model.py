"""The load tool with the real default model on a 3-node ray.cluster_utils.Cluster, 3
workers (slow on 2 cores: part of `make load-test`, not CI; CI runs the default model
through the load tool on one node in tests/serve/test_serve.py)."""

import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from cluster.config import ClusterConfig
from deploy import service
from tests.cluster.test_load_cluster import SCALE, load, show

pytestmark = pytest.mark.integration


@pytest.mark.slow  # `make load-test`: 3 workers with the default model on 2 cores is slow
def test_load_default_model_multi_node(default_model_dir):
    """A shorter run with the real default model on its own 3-node cluster."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, namespace="rayguide", log_to_driver=False)
    try:
        from cluster.launch import free_port
        config = ClusterConfig(num_workers=3, worker={"num_cpus": 1, "num_threads": 1},
                               engine={"num_kv_blocks": 512})
        svc = service.start(config, port=free_port())
        r = load(svc, clients=16, requests=int(32 * SCALE), duration_s=900, max_tokens=32,
                 session_share=0.25)
        show("default model, 3 nodes", r)
        assert r["failed"] == 0, r["error_examples"]
        assert r["valid_share"] == 1.0, r["invalid_examples"]
        assert r["leaks"]["leak_free"] and r["leaks"]["workers"] == 3, r["leaks"]
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
