"""Budget-aware closing of an output whose completion is longer than twice the closing
window (issue 39: real-world schemas with many required properties came back unclosed at
their budget): the closing estimate is taken from the grammar's start at admission, so
closing begins in time; the probe at twice the window (96 tokens left) found a completion
longer than what was left. The default model, scripted."""

import json

import jsonschema
import pytest

from core.params import LoopGuardParams
from tests.engine.test_loop_guard import generate, scripted

pytestmark = pytest.mark.integration

MANY_KEYS = {"type": "object", "properties": {
    "titles": {"type": "array", "items": {
        "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"],
        "additionalProperties": False}},
    **{f"required_property_number_{i}": {"type": "string"} for i in range(16)}},
    "required": ["titles"] + [f"required_property_number_{i}" for i in range(16)],
    "additionalProperties": False}


def test_a_completion_longer_than_twice_the_window_closes_in_time(make_engine):
    engine = make_engine()
    scripted(engine, '{"titles": [' + '{"title": "Titles"}, ' * 80)
    chunks, final = generate(engine, MANY_KEYS, max_tokens=300,
                             loop_guard=LoopGuardParams(enabled=False))
    text = "".join(c.text for c in chunks)
    jsonschema.validate(json.loads(text), MANY_KEYS)
    assert final.finish_reason == "length" and final.closed_early
