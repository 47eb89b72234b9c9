"""WorkerActor on a local Ray instance with the default model: streaming, guided requests,
bad input, session end releasing everything, load reports."""

import pytest
import ray

from grammar_cache.spec import GrammarSpec

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def worker(default_model_dir):
    from worker.actor import WorkerActor

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = WorkerActor.options(num_cpus=1).remote(
        {"num_kv_blocks": 256, "progress": False, "num_threads": 1}, "w0")
    ray.get(actor.health.remote())
    yield actor
    ray.shutdown()


def chat(text):
    return [{"role": "user", "content": text}]


def stream(actor, request):
    return [ray.get(ref) for ref in actor.generate.remote(request)]


def test_streams_chunks(worker):
    chunks = stream(worker, {"prompt": chat("Count from one to five."),
                             "params": {"max_new_tokens": 16, "temperature": 0.0}})
    assert len(chunks) > 2 and chunks[-1]["finished"]
    assert not any(c["finished"] for c in chunks[:-1])
    assert "".join(c["text"] for c in chunks).strip()


def test_guided_request(worker):
    chunks = stream(worker, {"prompt": chat("Is ice cold?"), "params": {"max_new_tokens": 8},
                             "grammar": GrammarSpec.choice(["yes", "no"]).to_dict()})
    assert "".join(c["text"] for c in chunks) in ("yes", "no")


def test_bad_request_raises(worker):
    with pytest.raises(ValueError, match="max_new_tokens"):
        stream(worker, {"prompt": "x", "params": {"max_new_tokens": 0}})
    with pytest.raises(ValueError, match="unknown request field"):
        stream(worker, {"prompt": "x", "colour": "red"})


def test_end_sessions_releases_everything(worker):
    for sid in ("a", "b"):
        stream(worker, {"prompt": chat("Hello"), "session_id": sid,
                        "params": {"max_new_tokens": 4},
                        "grammar": GrammarSpec.regex("[a-z]{1,8}").to_dict()})
    load = ray.get(worker.load.remote())
    assert load["live_sessions"] == 2 and load["worker_id"] == "w0" and load["node_id"]
    assert ray.get(worker.end_sessions.remote(["a", "b"])) == 2
    load = ray.get(worker.load.remote())
    assert load["live_sessions"] == 0 and load["live_processors"] == 0
    assert load["free_blocks"] == load["total_blocks"]
