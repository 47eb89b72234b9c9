"""The load tool as a bench script: `python bench/load.py --url http://127.0.0.1:8000 ...`
(the same as `rayguide loadtest`; see deploy/loadtest.py).

``python bench/load.py --smoke [--json]`` starts its own service first (a private Ray
instance, one worker with the tiny random-weight model), sends it a few requests of every
kind through the same load tool, and stops it: a check that the tool runs end to end.
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deploy.loadtest import main  # noqa: E402


def smoke(argv: list[str]) -> int:
    import ray

    from cluster.config import ClusterConfig
    from cluster.launch import free_port
    from deploy import service
    from bench.report import tiny_model

    with tempfile.TemporaryDirectory(prefix="rayguide-smoke-") as tmp:
        model = tiny_model(Path(tmp) / "tiny-llama")
        port = free_port()  # outside the range of outgoing connections
        svc = service.start(ClusterConfig(model=model, num_workers=1,
                                          worker={"num_cpus": 0.1, "num_threads": 1}),
                            port=port)
        try:
            return main(["--url", svc.url, "--clients", "4", "--requests", "12",
                         "--max-tokens", "12", "--duration", "120"] + argv)
        finally:
            service.stop(svc)
            ray.shutdown()


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--smoke" in args:
        args.remove("--smoke")
        sys.exit(smoke(args))
    sys.exit(main(args))
