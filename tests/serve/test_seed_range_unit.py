"""A seed outside [0, 2^63 - 1] is the client's mistake, answered with a 400 naming
``seed`` and its range at the edge (and as a line error in a batch job), never passed on
to a worker whose generator cannot take it."""

import pytest

from deploy import batch_job
from deploy import openai_api as api
from deploy.errors import APIError
from deploy.settings import Limits

pytestmark = pytest.mark.unit


def chat(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return api.plan_chat(api.parse_request(api.ChatCompletionRequest, body), Limits())


@pytest.mark.parametrize("seed", [2**63, 2**64 + 5, -1, -(2**63)])
def test_seed_out_of_range_is_a_400_naming_seed(seed):
    with pytest.raises(APIError, match=r"seed must be in \[0, 9223372036854775807\]") as err:
        chat(seed=seed)
    assert err.value.status == 400 and err.value.param == "seed"


def test_completion_seed_out_of_range():
    body = {"prompt": "x", "seed": 2**63}
    with pytest.raises(APIError) as err:
        api.plan_completion(api.parse_request(api.CompletionRequest, body), Limits())
    assert err.value.status == 400 and err.value.param == "seed"


def test_edge_seeds_pass_and_n_samples_stay_in_range():
    assert chat(seed=0).requests[0].params.seed == 0
    plan = chat(seed=api.MAX_SEED, n=3)
    assert [r.params.seed for r in plan.requests] == [api.MAX_SEED, 0, 1]


def test_batch_line_seed_out_of_range():
    with pytest.raises(batch_job.LineError, match="seed must be in"):
        batch_job.params_of({"prompt": "x", "seed": 2**63}, {})
    assert batch_job.params_of({"prompt": "x", "seed": 7}, {}).seed == 7
