"""Post-validation with schema keywords of the wrong type: a message, never an exception
(it runs at finish, on the engine thread)."""

import pytest

from worker.guided.validation import approximated_keywords, validate_json

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("value", ["x", [], {}, float("inf"), 0.5])
def test_a_multiple_of_that_is_not_an_integer_is_approximated(value):
    assert approximated_keywords({"type": "integer", "multipleOf": value}) == ["multipleOf"]


@pytest.mark.parametrize("value", [3, 2.0, True, None])
def test_an_integer_multiple_of_is_exact(value):
    assert approximated_keywords({"type": "integer", "multipleOf": value}) == []


@pytest.mark.parametrize("schema, text", [
    ({"type": "integer", "multipleOf": "x"}, "3"),
    ({"type": "string", "pattern": 5}, '"a"'),
    ({"type": "array", "minItems": -1}, "[]"),
    ({"type": "object", "required": "a"}, "{}"),
    ({"$ref": "file:///etc/passwd"}, "{}"),
])
def test_a_schema_that_cannot_be_used_says_so(schema, text):
    error = validate_json(schema, text)
    assert error.startswith("the schema could not be used for validation"), error
    assert "root:" not in error
