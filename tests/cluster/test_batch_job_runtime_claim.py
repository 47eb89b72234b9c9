"""The batch job's runtime claim on a real Ray (deploy/batch_job.py): the named actor a job
creates before it starts a runtime of its own. One claim at a time on a cluster; the
holder is named to whoever finds it; release_runtime frees it (after the runtime's actors),
so the next job can claim. The waiting logic around it is in
tests/serve/test_batch_job_hardening_unit.py."""

import pytest

from deploy import batch_job

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_local(shared_ray):
    with shared_ray():
        yield


def test_one_claim_per_cluster(ray_local):
    import ray

    assert batch_job.runtime_claim_owner() is None
    assert batch_job.claim_runtime("job-a")
    assert not batch_job.claim_runtime("job-b")  # the name is taken: job b must wait
    assert batch_job.runtime_claim_owner() == "job-a"

    @ray.remote(num_cpus=0)
    class Stand:  # an actor of "job a's runtime"
        def ping(self):
            return True

    Stand.options(name="rayguide_claim_test_actor", namespace="rayguide").remote()
    batch_job.release_runtime(["rayguide_claim_test_actor", batch_job.RUNTIME_CLAIM])
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert "rayguide_claim_test_actor" not in names
    assert batch_job.runtime_claim_owner() is None
    assert batch_job.claim_runtime("job-b")
    assert batch_job.runtime_claim_owner() == "job-b"
    batch_job.release_runtime([batch_job.RUNTIME_CLAIM])
    assert batch_job.runtime_claim_owner() is None
