"""Digit guards on values of any type (issue 39): a property with no ``type``, a ``{}`` or
``true`` schema, an object's other properties left open, an array of anything, at any
depth: a 30-digit integer or fraction is refused there on both engines, as for a typed
number, and ordinary values of every type are still taken. llguidance gets them through
schema_options.number_guards (its untyped values had none); xgrammar bounds every digit
run of its grammar. Checked on a byte-level vocabulary (no model needed)."""

import json

import pytest

from core.grammar_spec import GrammarSpec
from tests.engine.test_llguidance_guards_unit import ENGINES, accepts
from worker.guided.schema_options import number_guards

pytestmark = pytest.mark.unit


def obj(v, **extra) -> dict:
    return {"type": "object", "properties": {"v": v}, "required": ["v"], **extra}


SCHEMAS = {
    "no type": obj({"description": "anything"}),
    "empty": obj({}),
    "true": obj(True),
    "string keywords only": obj({"minLength": 1}),
    "array of anything": obj({"type": "array"}),
    "array of {}": obj({"type": "array", "items": {}}),
    "tuple then anything": obj({"type": "array", "prefixItems": [{"type": "string"}]}),
    "open object": obj({"type": "object"}),
    "additionalProperties true": {"type": "object", "additionalProperties": True},
    "in a definition": {"$defs": {"free": {}}, **obj({"$ref": "#/$defs/free"})},
    "anyOf branch": obj({"anyOf": [{"type": "string"}, {}]}),
}
BIG = ["1" * 30, "0." + "3" * 30, "-" + "2" * 20]


def docs(name: str, number: str) -> list[str]:
    if name == "additionalProperties true":
        return ['{"v": %s}' % number, '{"v": {"w": [%s]}}' % number]
    if name.startswith(("array", "tuple")):
        return ['{"v": ["a", %s]}' % number, '{"v": ["a", [{"w": %s}]]}' % number]
    if name == "open object":
        return ['{"v": {"w": %s}}' % number]
    if name == "string keywords only":
        return ['{"v": %s}' % number]
    return ['{"v": %s}' % number, '{"v": [1, {"w": %s}]}' % number]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_untyped_numbers_are_bounded(engine, name):
    if engine == "xgrammar" and name.startswith("tuple"):
        pytest.skip("xgrammar 0.2.8 closes a prefixItems tuple (no further items at all)")
    spec = GrammarSpec.json_schema(SCHEMAS[name], strict=False)
    for number in BIG:
        for doc in docs(name, number):
            assert not accepts(engine, spec, doc), (engine, name, doc)
    for number in ("7", "-3.25", "123456789012345"):
        for doc in docs(name, number):
            assert accepts(engine, spec, doc), (engine, name, doc)


@pytest.mark.parametrize("engine", ENGINES)
def test_untyped_values_of_every_type_are_still_taken(engine):
    spec = GrammarSpec.json_schema(obj({}), strict=False)
    for value in ('"text"', "null", "true", '[1, "a", {"b": [null]}]', '{"a": {"b": 2.5}}'):
        assert accepts(engine, spec, '{"v": %s}' % value), (engine, value)


def test_a_schema_whose_meaning_depends_on_evaluation_gets_number_bounds_only():
    schema = obj({"type": "object"}, unevaluatedProperties=False)
    out = number_guards(schema, 15, 10)
    assert "additionalProperties" not in out["properties"]["v"]
    assert "$defs" not in out
    assert number_guards(obj({}), 15, 10)["properties"]["v"]["$ref"].startswith("#/$defs/")
    assert number_guards(obj({}), 0, 0) == obj({})  # guards off: left as written
