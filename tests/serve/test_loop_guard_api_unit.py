"""The loop guard at the HTTP edge (no Ray, no model): the request field, its errors,
and the response's report."""

import pickle

import pytest

from core.params import LOOP_GUARD_BOUNDS, LoopGuardFieldError, LoopGuardParams
from core.request import RequestOutput
from deploy import openai_api as api
from deploy import responses
from deploy.errors import APIError
from deploy.settings import Limits

pytestmark = pytest.mark.unit


def plan(**body):
    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"}, **body}
    return api.plan_chat(api.parse_request(api.ChatCompletionRequest, body), Limits())


def test_loop_guard_field_reaches_every_choice():
    assert plan().requests[0].loop_guard is None  # the engine's default
    off = plan(loop_guard=False, n=2)
    assert all(r.loop_guard == LoopGuardParams(enabled=False) for r in off.requests)
    tuned = plan(loop_guard={"min_repeats": 4, "hold_tokens": 0})
    assert tuned.requests[0].loop_guard.min_repeats == 4
    assert tuned.requests[0].loop_guard.hold_tokens == 0


@pytest.mark.parametrize("value, words", [
    ({"repeats": 3}, "unknown loop_guard field"),
    ({"min_repeats": 1}, "min_repeats"),
    ({"hold_tokens": 1000}, "hold_tokens"),
    ([1, 2], "loop_guard"),
])
def test_bad_loop_guard_is_a_400_naming_it(value, words):
    with pytest.raises(APIError) as err:
        plan(loop_guard=value)
    assert err.value.status == 400 and words in str(err.value)


@pytest.mark.parametrize("field", sorted(LOOP_GUARD_BOUNDS))
def test_every_loop_guard_field_is_capped_with_a_400_naming_it(field):
    # a field without a cap let a request make its guard's work or its cuts unbounded
    low, high = LOOP_GUARD_BOUNDS[field]
    assert getattr(LoopGuardParams(), field) <= high  # the default is inside
    assert getattr(LoopGuardParams(**{field: high}), field) == high
    for bad in (high + 1, 10**9, low - 1, True, "3"):
        with pytest.raises(APIError) as err:
            plan(loop_guard={field: bad})
        assert err.value.status == 400 and err.value.param == f"loop_guard.{field}", bad
        assert f"loop_guard.{field}" in err.value.message


def test_the_field_error_survives_pickling():  # Ray carries it between processes
    err = pickle.loads(pickle.dumps(LoopGuardFieldError("max_cuts", "too many")))
    assert err.field == "max_cuts" and str(err) == "too many"


def test_the_guided_report_says_a_loop_was_cut():
    out = RequestOutput("r", '{"a": 1}', finished=True, finish_reason="stop", loop_cuts=2,
                        validation="valid")
    report = responses.guided_report(out)
    assert report["loop_cut"] is True and report["loop_cuts"] == 2
    assert responses.guided_report(RequestOutput("r"))["loop_cut"] is False
