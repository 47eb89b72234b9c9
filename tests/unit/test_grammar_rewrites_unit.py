"""The exact rewrites that let llguidance take a JSON schema it would refuse
(worker/guided/schema_rewrites.py: ``exact_rewrites``): an enum-bounded node filtered by
the validator, ``not`` negated, ``oneOf`` as ``anyOf`` where its branches cannot overlap.
Each rule: its output, and llguidance (on a byte tokenizer, so no model) accepting a
valid instance and rejecting an invalid one; and where a rewrite would not be exact, the
schema is left as written (llguidance refuses it, ``auto`` sends it to xgrammar)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.grammar_spec import GrammarSpec
from worker.guided.backend import EngineRefused
from worker.guided.llguidance_backend import _llguidance_grammar
from worker.guided.schema_options import strict_schema
from worker.guided.schema_rewrites import exact_rewrites
from worker.guided.validation import validate_json

pytestmark = pytest.mark.unit

llguidance = pytest.importorskip("llguidance")
BYTES = llguidance.LLTokenizer("byte")


def accepts(schema, value) -> bool:
    """llguidance, as served (strict, the spaced layout), takes ``value`` whole."""
    grammar = _llguidance_grammar(GrammarSpec.json_schema(schema))
    m = llguidance.LLMatcher(BYTES, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(BYTES.tokenize_str(json.dumps(value))) and m.is_accepting()


def check(schema, valid, invalid):
    """The instances are what the validator says, and llguidance agrees."""
    for value in valid:
        assert validate_json(schema, json.dumps(value)) is None, value
        assert accepts(schema, value), value
    for value in invalid:
        assert validate_json(schema, json.dumps(value)) is not None, value
        assert not accepts(schema, value), value


def refused(schema) -> bool:
    """llguidance will not compile the schema (as ``LLGuidanceBackend.compile`` finds)."""
    try:
        grammar = _llguidance_grammar(GrammarSpec.json_schema(schema))
    except EngineRefused:
        return True
    return llguidance.LLMatcher(BYTES, grammar, log_level=0).is_error()


def test_an_enum_bounded_node_becomes_the_enum_of_the_values_it_allows():
    schema = {"allOf": [{"enum": [{"a": 1}, {"a": 2}, {"a": 3}]},
                        {"not": {"properties": {"a": {"const": 1}}}}]}
    assert exact_rewrites(schema) == {"enum": [{"a": 2}, {"a": 3}]}
    check(schema, [{"a": 2}, {"a": 3}], [{"a": 1}, {"a": 4}, {}])
    # nested, with a reference into the definitions
    nested = {"type": "object", "properties": {"v": {"const": 5, "not": {"$ref": "#/$defs/odd"}}},
              "$defs": {"odd": {"multipleOf": 2}}}
    assert exact_rewrites(nested)["properties"]["v"] == {"enum": [5]}
    check(nested, [{"v": 5}, {}], [{"v": 4}, {"v": 6}])
    # nothing left: the node allows nothing
    assert exact_rewrites({"properties": {"v": {"enum": ["x"], "not": {"const": "x"}}}}) == {
        "properties": {"v": False}}
    # an enum under keywords llguidance has is left alone
    plain = {"enum": ["a", "b"], "type": "string"}
    assert exact_rewrites(plain) == plain


def test_not_of_a_type_is_the_other_types():
    schema = {"type": "object", "properties": {"x": {"not": {"type": ["string", "null"]}}}}
    assert exact_rewrites(schema)["properties"]["x"] == {
        "allOf": [{"type": ["boolean", "object", "array", "number", "integer"]}]}
    check(schema, [{"x": 1}, {"x": 1.5}, {"x": [1]}, {"x": True}], [{"x": "s"}, {"x": None}])
    # "not integer" leaves the numbers that are not integers: no type list says that
    assert exact_rewrites({"not": {"type": "integer"}}) == {"not": {"type": "integer"}}
    assert refused({"not": {"type": "integer"}})


def test_not_of_required_is_a_name_absent_on_an_object():
    schema = {"type": "object", "properties": {"a": {}, "b": {}},
              "not": {"required": ["a", "b"]}}
    assert exact_rewrites(schema)["allOf"] == [
        {"type": "object", "anyOf": [{"properties": {"a": False}}, {"properties": {"b": False}}]}]
    check(schema, [{"a": 1}, {"b": 2}, {}], [{"a": 1, "b": 2}])
    # De Morgan: not (a and b required) through an allOf
    both = {"type": "object", "properties": {"a": {}, "b": {}},
            "not": {"allOf": [{"required": ["a"]}, {"required": ["b"]}]}}
    check(both, [{"a": 1}, {}], [{"a": 1, "b": 2}])
    # on a value that is no object, required holds: not required rejects it
    bare = {"not": {"required": ["a"]}}
    assert exact_rewrites(bare) == {"allOf": [{"type": "object", "properties": {"a": False}}]}
    check(bare, [{}, {"b": 1}], [{"a": 1}, "s", 3])


def test_not_of_anything_allows_nothing():
    schema = {"type": "object", "properties": {"id": {"type": "string"}},
              "patternProperties": {"^x": {"not": {}}}}
    assert exact_rewrites(schema)["patternProperties"] == {"^x": False}
    check(schema, [{"id": "a"}, {"y": 1}], [{"xa": 1}])
    # not of not is the schema itself
    double = {"type": "object", "properties": {"a": {"not": {"not": {"type": "integer"}}}}}
    check(double, [{"a": 1}], [{"a": "s"}])


def test_not_of_a_property_is_the_property_present_and_failing():
    schema = {"type": "object", "properties": {"a": {}, "b": {}},
              "not": {"properties": {"a": {"type": "string"}, "b": False}}}
    assert exact_rewrites(schema)["allOf"] == [{"anyOf": [
        {"type": "object", "required": ["a"],
         "properties": {"a": {"type": ["null", "boolean", "object", "array", "number",
                                       "integer"]}}},
        {"type": "object", "required": ["b"], "properties": {"b": True}}]}]
    check(schema, [{"a": 1}, {"b": 1}, {"a": "s", "b": 1}], [{"a": "s"}, {}])


def test_a_not_with_no_exact_negation_is_left_for_xgrammar():
    for negated in ({"const": "x"}, {"minimum": 3}, {"pattern": "^a"},
                    {"properties": {"a": {}}, "additionalProperties": False}):
        schema = {"type": "object", "properties": {"s": {"not": negated}}}
        assert exact_rewrites(schema) == schema
        assert refused(schema)


def test_one_of_with_branches_of_distinct_types_is_any_of():
    schema = {"type": "object", "properties": {"v": {"oneOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "integer"}},
        {"$ref": "#/definitions/obj"}]}}, "definitions": {"obj": {"type": "object"}}}
    assert "anyOf" in exact_rewrites(schema)["properties"]["v"]
    check(schema, [{"v": "a"}, {"v": [1]}, {"v": {}}], [{"v": 1}, {"v": True}])
    # integer and number overlap: no rewrite
    overlap = {"oneOf": [{"type": "integer"}, {"type": "number", "maximum": 9}]}
    assert exact_rewrites(overlap) == overlap
    assert refused(overlap)


def test_one_of_with_a_required_discriminator_is_any_of():
    record = {"type": "object", "properties": {"record": {"type": "string"}},
              "required": ["record"], "additionalProperties": False}
    alert = {"type": "object", "properties": {"alert": {"type": "string"}},
             "required": ["alert"], "additionalProperties": False}
    schema = {"oneOf": [record, alert]}  # one requires a name the other forbids
    assert exact_rewrites(schema) == {"anyOf": [record, alert]}
    check(schema, [{"record": "r"}, {"alert": "a"}], [{"record": "r", "alert": "a"}, {}])
    kinds = {"type": "object", "oneOf": [  # a required property whose values differ
        {"properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["kind"]},
        {"properties": {"kind": {"enum": ["b", "c"]}}, "required": ["kind"]}]}
    assert "anyOf" in exact_rewrites(kinds)
    check(kinds, [{"kind": "a", "x": 1}, {"kind": "c"}], [{"kind": "d"}, {"kind": "a", "x": "s"}])


def test_one_of_of_strings_anchored_on_different_literal_starts_is_any_of():
    schema = {"type": "object", "properties": {"href": {"oneOf": [
        {"type": "string", "pattern": "^https?://.+$"},
        {"type": "string", "pattern": "^\\./.+$"}]}}}
    assert "anyOf" in exact_rewrites(schema)["properties"]["href"]
    check(schema, [{"href": "https://a"}, {"href": "./a"}], [{"href": "a"}, {"href": 1}])
    for first, second in (("^ab", "^a"),  # one start inside the other
                          ("^a|b", "^b"),  # an alternation: "b" matches both
                          ("a", "^b"),  # not anchored
                          ("^x?y", "^y")):  # an optional character
        overlap = {"oneOf": [{"type": "string", "pattern": first},
                             {"type": "string", "pattern": second}]}
        assert exact_rewrites(overlap) == overlap, (first, second)


def test_one_of_that_may_overlap_is_left_for_xgrammar():
    # a value that is no object matches both: required and properties say nothing of it
    schema = {"oneOf": [{"required": ["a"], "properties": {"a": {"const": 1}}},
                        {"required": ["a"], "properties": {"a": {"const": 2}}}]}
    assert exact_rewrites(schema) == schema
    assert validate_json(schema, '"s"') is not None  # ("s" matches both branches)
    assert refused(schema)
    # a property required by neither branch: {} matches both
    loose = {"type": "object", "oneOf": [{"properties": {"k": {"const": 1}}},
                                         {"properties": {"k": {"const": 2}}}]}
    assert exact_rewrites(loose) == loose


def test_one_of_of_required_lists_is_one_list_present_and_the_others_incomplete():
    schema = {"properties": {"a": {}, "b": {}, "c": {}},
              "oneOf": [{"required": ["a"]}, {"required": ["b", "c"]}]}
    out = exact_rewrites(schema)
    assert out["anyOf"] == [
        {"required": ["a"], "allOf": [{"anyOf": [{"properties": {"b": False}},
                                                 {"properties": {"c": False}}]}]},
        {"required": ["b", "c"], "allOf": [{"properties": {"a": False}}]}]
    assert out["allOf"] == [{"type": "object"}]
    check(schema, [{"a": 1}, {"a": 1, "b": 2}, {"b": 1, "c": 2}],
          [{"a": 1, "b": 2, "c": 3}, {}, {"b": 1}, "s"])
    # a list inside another: that branch never matches alone
    nested = {"properties": {"a": {}, "b": {}}, "oneOf": [{"required": ["a"]},
                                                          {"required": ["a", "b"]}]}
    check(nested, [{"a": 1}], [{"a": 1, "b": 2}, {"b": 2}])


def test_const_is_no_keyword_in_draft_4():
    # draft 4 ignores "const": the branches are not told apart by it, nor is the node
    # bounded by it
    draft4 = "http://json-schema.org/draft-04/schema#"
    schema = {"$schema": draft4, "type": "object", "oneOf": [
        {"properties": {"k": {"const": "a"}}, "required": ["k"]},
        {"properties": {"k": {"const": "b"}}, "required": ["k"]}]}
    assert exact_rewrites(schema) == schema
    assert validate_json(schema, '{"k": "c"}') is not None  # (both branches match: 'c')
    bounded = {"$schema": draft4, "const": 1, "not": {"type": "string"}}
    assert "enum" not in exact_rewrites(bounded)
    later = {**schema, "$schema": "http://json-schema.org/draft-07/schema#"}
    assert "anyOf" in exact_rewrites(later)


# schema-shaped values with wrong-typed keywords, nested: what a client may send
_KEYWORDS = ("type", "properties", "required", "items", "prefixItems", "additionalProperties",
             "patternProperties", "enum", "const", "not", "oneOf", "anyOf", "allOf", "$ref",
             "$defs", "definitions", "if", "then", "else", "dependencies", "dependentRequired",
             "dependentSchemas", "contains", "uniqueItems", "minItems", "format", "pattern",
             "$schema")
_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False),
                    st.sampled_from(["a", "string", "object", "#", "#/$defs/a", "#/nope",
                                     "http://example.invalid/x", "draft-04"]))
_SCHEMAS = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(_KEYWORDS + ("a", "b")), inner,
                                            max_size=4)),
    max_leaves=24)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_SCHEMAS)
def test_rewrites_read_any_schema_shaped_value(schema):
    """The rewrites never raise on a client's schema, however its keywords are typed; and
    llguidance's grammar is built or refused (EngineRefused), never an error of ours."""
    exact_rewrites(strict_schema(schema))
    exact_rewrites(schema)
    try:
        spec = GrammarSpec.json_schema(schema)
    except ValueError:  # the spec refuses it itself (a 400 at the edge)
        return
    try:
        _llguidance_grammar(spec)
    except EngineRefused:
        pass
