"""Shared fixtures. The default model is converted once per machine (cached under
~/.cache/rayguide or $RAYGUIDE_CACHE_DIR) and loaded once per test session."""

import contextlib
import os
import tempfile

import pytest
import torch

# Tests count compiles and cache hits: the grammar cache's disk tier is off by default in
# the whole session (this process and the Ray processes, which inherit the environment),
# and any cache that turns it on (tests/cluster/test_grammar_replication.py) writes to a folder of
# this run's own, never to the user's ~/.cache (a second run would find it warm)
os.environ["RAYGUIDE_GRAMMAR_DISK"] = "0"
os.environ["RAYGUIDE_GRAMMAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="rayguide-grammars-")
# Without a GPU the device kernels (worker/models/triton_kernels.py) are tested on CPU
# tensors through Triton's interpreter, which is chosen when Triton is imported
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The engine tier (tests/suite.sh) runs its files on two workers, one file at a time each,
# in this order: the longest first (process CPU-s in session 17), so that the last file a
# worker runs once the Ray layers have ended is a short one and the other worker does not
# wait long for it
ENGINE_LONGEST_FIRST = ("test_engine.py", "test_device_engine.py", "test_conformance_engine.py",
                        "test_cuda_graphs.py", "test_overlap_engine.py",
                        "test_closing_long_engine.py", "test_guided_engine.py",
                        "test_reasoning.py", "test_gguf_convert.py")


def _engine_rank(path) -> int:
    if path.parent.name != "engine" or path.name not in ENGINE_LONGEST_FIRST:
        return len(ENGINE_LONGEST_FIRST)
    return ENGINE_LONGEST_FIRST.index(path.name)


def pytest_collection_modifyitems(config, items):
    # the modules on the shared Ray (below) run one after another at the end of their
    # layer's folder, so it starts once per layer; every other order is kept (a module's
    # tests stay together and in their order, also those that do not use Ray themselves)
    # (and those on the shared 3-node cluster first, one after another; in tests/engine
    # the longest files first)
    shared = {item.path for item in items if "shared_ray" in item.fixturenames}
    on_cluster = {item.path for item in items if "shared_cluster" in item.fixturenames}
    items[:] = sorted(items, key=lambda item: (str(item.path.parent), item.path in shared,
                                               item.path not in on_cluster,
                                               _engine_rank(item.path)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def _private_ray(*, num_cpus: int = 4, nodes: int = 0, node_cpus: int = 2,
                 head_resources: dict | None = None):
    """A Ray of this test module's own: a local instance, or with ``nodes`` a
    ray.cluster_utils.Cluster (a head of ``num_cpus`` and ``nodes`` more). Yields the Cluster
    (None for a local instance). Serve, Ray and the cluster are shut down on the way out,
    also when the start itself (or whatever the module starts inside) fails, so the next
    module starts from a clean slate."""
    import ray

    cluster = None
    try:
        if nodes:
            from ray.cluster_utils import Cluster
            cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": num_cpus, "resources": head_resources or {},
                "include_dashboard": False})
            for _ in range(nodes):
                cluster.add_node(num_cpus=node_cpus)
            ray.init(address=cluster.address, namespace="rayguide", log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     namespace="rayguide")
        yield cluster
    finally:
        if ray.is_initialized():
            from ray import serve
            with contextlib.suppress(Exception):
                serve.shutdown()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


class _SharedRay:
    """One local Ray instance for the modules that ask for ``shared_ray``: each of them
    starts its runtime, Serve and app on it and leaves nothing behind (Serve is shut down,
    every named actor killed and gone), so the next module finds it as new, without the
    ~6 s a start and stop of Ray cost on two cores. Any other module (a private Ray, a
    `ray start` head, a unit test that fakes ``ray.init``) gets no Ray in this process: the
    shared one is stopped before it starts.

    With ``nodes``: the same for the modules that ask for ``shared_cluster``, a
    ray.cluster_utils.Cluster of a head (2 CPUs and a ``head`` resource, for what a module
    keeps off the nodes it removes) and ``nodes`` nodes of 2 CPUs (a start and stop: ~8 s
    and ~9 CPU-s here)."""

    CPUS = 6  # as many as the most any of these modules asked for on its own

    def __init__(self, nodes: int = 0):
        self.up = False
        self.nodes = nodes
        self.cluster = None  # the ray.cluster_utils.Cluster, with ``nodes``

    def start(self):
        import ray

        if self.up:
            return
        assert not ray.is_initialized(), "a Ray left running by an earlier module"
        from cluster import launch

        launch.fast_death_notice()  # as `rayguide serve` and `up` set it for the Ray they start
        if self.nodes:
            from ray.cluster_utils import Cluster

            self.cluster = Cluster(initialize_head=True,
                                   head_node_args={"num_cpus": 2, "resources": {"head": 1},
                                                   "include_dashboard": False})
            self.up = True  # from here stop() takes it down, also if what follows fails
            for _ in range(self.nodes):
                self.cluster.add_node(num_cpus=2)
            ray.init(address=self.cluster.address, namespace="rayguide", log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=self.CPUS, include_dashboard=False,
                     log_to_driver=False, namespace="rayguide")
        self.up = True

    def clear(self, timeout_s: float = 60.0):
        """Serve (its proxy and port, every app) and every named actor of every namespace
        gone; a module that leaves an unnamed actor referenced keeps it (none does)."""
        import time

        import ray
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        deadline = time.monotonic() + timeout_s
        while named := ray.util.list_named_actors(all_namespaces=True):
            for actor in named:
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]),
                             no_restart=True)
            if time.monotonic() > deadline:
                self.stop()  # the next module gets a Ray of its own
                raise AssertionError(f"named actors outlived their module: {named}")
            time.sleep(0.1)

    def stop(self):
        import ray

        if self.up:
            if self.cluster is not None:
                from ray import serve

                with contextlib.suppress(Exception):
                    serve.shutdown()
            ray.shutdown()
            if self.cluster is not None:
                self.cluster.shutdown()
                self.cluster = None
            self.up = False


_SHARED_RAY = _SharedRay()
_SHARED_CLUSTER = _SharedRay(nodes=2)


@pytest.fixture(scope="module", autouse=True)
def _no_shared_ray_unless_asked(request):
    """A module that does not use the shared Ray (or the shared cluster) runs without it."""
    asks = set().union(*(item.fixturenames for item in request.session.items
                         if item.module is request.module))
    for name, shared in (("shared_ray", _SHARED_RAY), ("shared_cluster", _SHARED_CLUSTER)):
        if name not in asks:
            shared.stop()
    yield


@pytest.fixture(scope="session")
def shared_ray():
    """``with shared_ray():`` in a module fixture: Ray up (the session's one instance, see
    ``_SharedRay``); on the way out, also when what the module started inside fails, Serve
    and every named actor are gone again."""

    @contextlib.contextmanager
    def open_shared():
        _SHARED_RAY.start()
        try:
            yield
        finally:
            _SHARED_RAY.clear()

    yield open_shared
    _SHARED_RAY.stop()


@pytest.fixture(scope="session")
def shared_cluster():
    """``with shared_cluster() as cluster:`` in a module fixture: the session's 3-node
    ray.cluster_utils.Cluster up (``_SharedRay`` with nodes), yielded for a module that adds
    or removes nodes; on the way out Serve and every named actor are gone again, as with
    ``shared_ray``."""

    @contextlib.contextmanager
    def open_shared():
        _SHARED_CLUSTER.start()
        try:
            yield _SHARED_CLUSTER.cluster
        finally:
            _SHARED_CLUSTER.clear()

    yield open_shared
    _SHARED_CLUSTER.stop()


@pytest.fixture(scope="session")
def ray_runtime():
    """``with ray_runtime(num_cpus=4) as cluster:`` in a module (or function) fixture: a
    private Ray that is always shut down; see ``_private_ray`` for the arguments."""
    return _private_ray


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def kernel_threads(request):
    """The C kernels split their rows over torch's thread count: each kernel test runs on
    one thread and on three (an odd count, above the cores of a small machine), whatever
    the count the suite runs with (`make test` runs the in-process layers with
    OMP_NUM_THREADS=1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def default_model_dir():
    from worker.models.gguf_convert import ensure_converted

    return ensure_converted(None, progress=False)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    from worker.models.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def default_model(default_model_dir):
    from worker.models.loader import load_model

    return load_model(default_model_dir, progress=False)


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir, tmp_path_factory):
    """A tiny random-weight Llama with the default model's real tokenizer: fast to load,
    for tests of the runtime's plumbing."""
    from worker.models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.fixture
def make_engine(default_model_dir, default_model, default_tokenizer):
    """Builds an engine over the shared default model; keyword args go to EngineConfig."""
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine

    def build(**overrides):
        overrides.setdefault("progress", False)
        overrides.setdefault("num_kv_blocks", 256)  # 4096 tokens: plenty, and quick to allocate
        # tests check answers, not the machine's speed: CI's engine tier runs at nice 19
        # beside the Ray tier, where a compile waited past the default 60 s
        overrides.setdefault("grammar_timeout_s", 300.0)
        return LLMEngine(EngineConfig(**overrides), model=default_model,
                         tokenizer=default_tokenizer, model_dir=default_model_dir)

    return build


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from worker.models.loader import load_model

    return load_model(tiny_model_dir, progress=False)


@pytest.fixture
def make_tiny_engine(tiny_model_dir, tiny_model, default_tokenizer):
    """``make_engine`` over the tiny random-weight model (the same tokenizer object, so a
    test that sets its chat template sets this engine's): for tests whose model is scripted
    (they overwrite every logit the model gives), where the default model's forward was
    most of their time and decided nothing."""
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine

    def build(**overrides):
        overrides.setdefault("progress", False)
        overrides.setdefault("num_kv_blocks", 256)
        overrides.setdefault("grammar_timeout_s", 300.0)  # as make_engine's
        return LLMEngine(EngineConfig(**overrides), model=tiny_model,
                         tokenizer=default_tokenizer, model_dir=tiny_model_dir)

    return build
