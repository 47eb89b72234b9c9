"""The schema closer (worker/guided/json_closing.py): for every prefix of a valid document,
the completion it writes makes a document the schema accepts (or it says None)."""

import json

import pytest

from worker.guided.json_closing import JsonScan, SchemaNodes
from worker.guided.validation import validate_json

pytestmark = pytest.mark.unit

LONG_OBJECTS = {"type": "object", "properties": {"items": {
    "type": "array", "minItems": 12, "items": {
        "type": "object", "properties": {k: {"type": "string", "minLength": 24}
                                         for k in ("name", "detail", "source")},
        "required": ["name", "detail", "source"]}}}, "required": ["items"]}
MIXED = {"type": "object", "properties": {
    "color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 3},
    "flags": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"type": "boolean"},
                                           "minItems": 2}]},
    "ref": {"$ref": "#/$defs/point"}, "note": {"type": "string"}},
    "required": ["color", "n", "flags", "ref"],
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"},
                                                         "y": {"type": "number"}},
                        "required": ["x", "y"]}}}
CASES = [
    (LONG_OBJECTS, {"items": [{"name": f"The Louvre, Paris, France {i}", "detail": "x" * 30,
                               "source": "https://example.org/louvre"} for i in range(12)]}),
    (MIXED, {"color": "green", "n": 12, "flags": [True, False, True], "ref": {"x": 1.5, "y": -2},
             "note": "a \"quoted\" word, a \\ and \u00e9"}),
    (MIXED, {"note": "first", "color": "red", "n": 3, "flags": None, "ref": {"y": 1e3, "x": 0}}),
]


def complete(schema, text, layout=(", ", ": ")):
    scan = JsonScan(SchemaNodes(schema))
    scan.feed(text)
    parts = scan.completion_parts(layout)  # the pieces the closing estimate counts
    whole = scan.completion(layout)
    assert (parts is None and whole is None) or "".join(parts) == whole
    if parts and scan.stack:  # every open container has its piece, after the value's
        assert len(parts) >= len(scan.stack)
    return whole


@pytest.mark.parametrize("schema, value", CASES)
@pytest.mark.parametrize("layout", [(", ", ": "), (",", ":")])
def test_every_prefix_of_a_valid_document_completes_valid(schema, value, layout):
    text = json.dumps(value, separators=layout)
    for i in range(len(text) + 1):
        rest = complete(schema, text[:i], layout)
        assert rest is not None, (text[:i],)
        assert validate_json(schema, text[:i] + rest) is None, (text[:i], rest)


@pytest.mark.parametrize("schema, value", CASES)
@pytest.mark.parametrize("layout", [(", ", ": "), (",", ":")])
def test_a_scan_fed_as_it_goes_completes_as_a_fresh_one(schema, value, layout):
    # the pieces it keeps between calls (an open container's, while its state is the
    # same) are those a scan of the same text writes anew, asked at every character and
    # at every few (a piece kept from several values back)
    text = json.dumps(value, separators=layout)
    reused = 0
    for every in (1, 3, 7, 29, 61):
        going = JsonScan(SchemaNodes(schema))
        for i, ch in enumerate(text):
            going.feed(ch)
            if i % every:
                continue
            fresh = JsonScan(going.nodes)
            fresh.feed(text[:i + 1])
            before = dict(going._pieces)
            assert going.completion_parts(layout) == fresh.completion_parts(layout), (
                every, text[:i + 1])
            reused += sum(1 for d, kept in going._pieces.items() if before.get(d) is kept)
    assert reused >= len(text) // 2  # (the pieces were read again, not only written)


def test_the_separator_written_is_finished_in_the_layout():
    assert complete({"type": "array", "items": {"type": "integer"}, "minItems": 2},
                    "[1,") == " 0]"


def test_what_it_does_not_know_is_none_and_a_clone_is_independent():
    patterned = {"type": "object", "properties": {"d": {"type": "string", "pattern": "^[0-9]{4}$"}},
                 "required": ["d"]}
    assert complete(patterned, '{"d": "12') is None  # a partial string under a pattern
    assert complete(patterned, '{"d": ') == '"0000"}'
    assert complete({"type": "object"}, "{} x") is None  # not one JSON document
    scan = JsonScan(SchemaNodes(LONG_OBJECTS))
    scan.feed('{"items": [')
    other = scan.clone()
    other.feed('{"name": "')
    assert scan.completion().startswith('{"name": "') and other.completion().startswith("a" * 24)


def test_the_longest_choice_is_an_optional_object_of_required_keys():
    schema = {"type": "object", "properties": {
        "a": {"type": "string"},
        "details": {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(6)},
                    "required": [f"k{i}" for i in range(6)]}}, "required": ["a"]}
    longest = SchemaNodes(schema).jumps((", ", ": "))[0]
    assert longest.startswith(', "details": {') and longest.count('"k') == 6


def test_a_free_string_is_one_whose_text_nothing_bounds_but_its_least_length():
    def free(schema, text):
        scan = JsonScan(SchemaNodes(schema))
        scan.feed(text)
        return scan.in_free_string()
    obj = {"type": "object", "properties": {"a": {"type": "string", "minLength": 3,
                                                  "title": "A"}}}
    assert free(obj, '{"a": "xy')
    assert not free(obj, '{"a')  # a key
    assert not free(obj, '{"a": "x\\')  # an escape under way
    assert not free(obj, '{"a": "xy"')  # ended
    for bound in ({"maxLength": 9}, {"pattern": "^x+$"}, {"enum": ["xyz"]}, {"format": "date"}):
        schema = {"type": "object", "properties": {"a": {"type": "string", **bound}}}
        assert not free(schema, '{"a": "xy'), bound
    either = {"anyOf": [{"type": "string"}, {"type": "string", "minLength": 5}]}
    assert not free({"type": "object", "properties": {"a": either}}, '{"a": "xy')
    assert free({"type": "object", "properties": {"a": {"anyOf": [
        {"type": "string"}, {"type": "integer"}]}}}, '{"a": "xy')  # one takes a string
    assert not free({"anyOf": [obj, {"type": "object", "properties": {"b": {}}}]}, '{"a": "xy')
    assert free({"type": "object"}, '{"k": "any')  # json_object's
