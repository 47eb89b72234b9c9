"""The request field ``speculative`` (rayguide): true / false reach the engine's
``SamplingParams.speculative`` (null: the server's default), on the chat and completion
routes; anything else is a 400 naming the field."""

import pytest

from deploy import openai_api as api
from deploy.errors import APIError
from deploy.settings import Limits

pytestmark = pytest.mark.unit


def chat(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return api.plan_chat(api.parse_request(api.ChatCompletionRequest, body), Limits())


def test_speculative_reaches_the_engine():
    assert chat().requests[0].params.speculative is None
    assert chat(speculative=False).requests[0].params.speculative is False
    assert chat(speculative=True, n=2).requests[1].params.speculative is True
    plan = api.plan_completion(api.parse_request(api.CompletionRequest, {
        "prompt": "x", "speculative": False}), Limits())
    assert plan.requests[0].params.speculative is False


def test_a_speculative_that_is_not_a_boolean_is_a_400():
    with pytest.raises(APIError) as err:
        chat(speculative="sometimes")
    assert err.value.status == 400 and "speculative" in str(err.value.param or err.value)
