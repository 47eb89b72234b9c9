"""core/json_schema.py: the one ``$ref`` resolver and the one subschema walker, and the
parsed schema a GrammarSpec keeps (``GrammarSpec.parsed``)."""

import pickle

import pytest

from core.grammar_spec import GrammarSpec
from core.json_schema import (RefError, Resolver, TooManyNodes, nested_deeper, pointer,
                              resolve, resolve_or_none, walk)

pytestmark = pytest.mark.unit

DOC = {"$defs": {"a/b": {"type": "string"}, "m~n": {"type": "integer"},
                 "with space": {"type": "null"}, "percent%": {"type": "boolean"}},
       "prefixItems": [{"const": 0}, {"const": 1}],
       "": {"title": "empty key"}}


# --- resolver ---------------------------------------------------------------------------------

@pytest.mark.parametrize("ref, expected", [
    ("#", DOC),
    ("#/$defs/a~1b", {"type": "string"}),  # ~1 is '/'
    ("#/$defs/m~0n", {"type": "integer"}),  # ~0 is '~'
    ("#/$defs/with%20space", {"type": "null"}),  # a URI fragment: percent-decoded
    ("#/%24defs/percent%25", {"type": "boolean"}),
    ("#/prefixItems/1", {"const": 1}),
    ("#/", {"title": "empty key"}),
])
def test_resolve_local_pointers(ref, expected):
    assert resolve(DOC, ref) == expected
    assert Resolver(DOC).resolve(ref) == expected


def test_percent_decoding_comes_before_tilde_unescaping():
    # RFC 6901 section 6: '%7E1' decodes to '~1', which is then the escape of '/'
    assert resolve(DOC, "#/$defs/a%7E1b") == {"type": "string"}


@pytest.mark.parametrize("ref", ["https://example.com/s.json", "other.json#/$defs/a",
                                 "file:///etc/passwd", "/$defs/a"])
def test_remote_references_are_refused(ref):
    with pytest.raises(RefError, match="points outside the schema"):
        resolve(DOC, ref)
    assert resolve_or_none(DOC, ref) is None


@pytest.mark.parametrize("ref, why", [
    ("#/$defs/missing", "points to nothing"),
    ("#/prefixItems/2", "points to nothing"),  # past the list
    ("#/prefixItems/01x", "points to nothing"),
    ("#/$defs/a~1b/type/x", "points to nothing"),  # into a string
    ("#anchor", "not a JSON pointer"),
])
def test_missing_targets_say_so(ref, why):
    with pytest.raises(RefError, match=why):
        resolve(DOC, ref)
    assert Resolver(DOC).get(ref) is None


def test_non_string_ref_is_an_error():
    with pytest.raises(RefError, match="must be a string"):
        resolve(DOC, 5)


def test_resolver_memoizes_targets_and_errors():
    class Counting(dict):
        reads = 0

        def __contains__(self, key):
            type(self).reads += 1
            return super().__contains__(key)

    root = Counting({"$defs": {"x": {"type": "string"}}})
    resolver = Resolver(root)
    assert resolver.resolve("#/$defs/x") is root["$defs"]["x"]
    reads = Counting.reads
    assert resolver.resolve("#/$defs/x") is root["$defs"]["x"]
    assert Counting.reads == reads  # the second time from the memo
    for _ in range(2):
        with pytest.raises(RefError):
            resolver.resolve("#/$defs/y")


def test_deref_follows_bare_references_and_stops_on_cycles():
    root = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/c"},
                      "c": {"type": "integer"},
                      "loop1": {"$ref": "#/$defs/loop2"}, "loop2": {"$ref": "#/$defs/loop1"},
                      "self": {"$ref": "#/$defs/self"}}}
    resolver = Resolver(root)
    assert resolver.deref({"$ref": "#/$defs/a"}) == {"type": "integer"}
    assert resolver.deref({"type": "null"}) == {"type": "null"}
    for name in ("loop1", "self"):
        with pytest.raises(RefError, match="refers to itself"):
            resolver.deref({"$ref": f"#/$defs/{name}"})


def test_a_recursive_schema_resolves():
    # a tree: the reference points at an ancestor; resolving it is one lookup, no loop
    tree = {"type": "object", "properties": {"children": {"type": "array",
                                                          "items": {"$ref": "#"}}}}
    assert resolve(tree, "#") is tree
    assert [s.pointer for s in walk(tree)] == ["", "/properties/children",
                                               "/properties/children/items"]


# --- walker -----------------------------------------------------------------------------------

# every keyword that holds subschemas, each with a marker subschema
EVERY = {
    "properties": {"p": {"title": "properties"}},
    "patternProperties": {"^x": {"title": "patternProperties"}},
    "additionalProperties": {"title": "additionalProperties"},
    "items": {"title": "items"},
    "prefixItems": [{"title": "prefixItems"}],
    "contains": {"title": "contains"},
    "anyOf": [{"title": "anyOf"}],
    "oneOf": [{"title": "oneOf"}],
    "allOf": [{"title": "allOf"}],
    "not": {"title": "not"},
    "if": {"title": "if"},
    "then": {"title": "then"},
    "else": {"title": "else"},
    "$defs": {"d": {"title": "$defs"}},
    "definitions": {"d": {"title": "definitions"}},
    "dependentSchemas": {"k": {"title": "dependentSchemas"}},
    "dependencies": {"k": {"title": "dependencies"}, "j": ["k"]},
    "propertyNames": {"title": "propertyNames"},
    "unevaluatedProperties": {"title": "unevaluatedProperties"},
    "unevaluatedItems": {"title": "unevaluatedItems"},
    "additionalItems": {"title": "additionalItems"},
    # data, never walked
    "enum": [{"title": "enum"}], "const": {"title": "const"},
    "default": {"title": "default"}, "examples": [{"title": "examples"}],
    "x-extension": {"title": "x-extension"},
}
EXPECTED = {
    "properties": "/properties/p", "patternProperties": "/patternProperties/^x",
    "additionalProperties": "/additionalProperties", "items": "/items",
    "prefixItems": "/prefixItems/0", "contains": "/contains", "anyOf": "/anyOf/0",
    "oneOf": "/oneOf/0", "allOf": "/allOf/0", "not": "/not", "if": "/if", "then": "/then",
    "else": "/else", "$defs": "/$defs/d", "definitions": "/definitions/d",
    "dependentSchemas": "/dependentSchemas/k", "dependencies": "/dependencies/k",
    "propertyNames": "/propertyNames", "unevaluatedProperties": "/unevaluatedProperties",
    "unevaluatedItems": "/unevaluatedItems", "additionalItems": "/additionalItems",
}


def test_walk_reaches_every_keyword_with_its_path():
    subs = list(walk(EVERY))
    assert subs[0].path == () and subs[0].node is EVERY and subs[0].depth == 0
    found = {s.node["title"]: s.pointer for s in subs[1:]}
    assert found == EXPECTED
    assert all(s.depth == 1 for s in subs[1:])


def test_lenient_walk_also_reads_unknown_keywords_but_never_data():
    found = {s.node["title"]: s.pointer for s in list(walk(EVERY, lenient=True))[1:]}
    assert found == {**EXPECTED, "x-extension": "/x-extension"}


def test_walk_paths_escape_and_count_depth():
    schema = {"properties": {"a/b": {"items": [{"anyOf": [True, {"type": "null"}]}]}}}
    subs = [(s.pointer, s.depth) for s in walk(schema)]
    assert subs == [("", 0), ("/properties/a~1b", 1), ("/properties/a~1b/items/0", 2),
                    ("/properties/a~1b/items/0/anyOf/0", 3),
                    ("/properties/a~1b/items/0/anyOf/1", 3)]
    assert resolve(schema, "#" + subs[-1][0]) == {"type": "null"}  # paths are pointers


def test_walk_visits_boolean_subschemas_and_document_order():
    schema = {"not": False, "anyOf": [{"title": "first"}, {"title": "second"}], "items": True}
    assert [(s.pointer, s.node) for s in walk(schema)][1:] == [
        ("/not", False), ("/anyOf/0", {"title": "first"}), ("/anyOf/1", {"title": "second"}),
        ("/items", True)]


def test_max_depth_prunes_and_max_nodes_raises():
    chain = {"title": 0}
    for i in range(1, 50):
        chain = {"not": chain, "title": i}
    assert max(s.depth for s in walk(chain, max_depth=10)) == 10
    assert len(list(walk(chain))) == 50
    assert len(list(walk(chain, max_nodes=50))) == 50
    with pytest.raises(TooManyNodes, match="more than 49"):
        list(walk(chain, max_nodes=49))


def test_walk_is_iterative():
    deep = {}
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = {"items": deep}
    assert sum(1 for _ in walk(deep)) == 5001


def test_seen_visits_shared_nodes_once():
    shared = {"type": "string"}
    schema = {"anyOf": [shared, {"items": shared}]}
    seen: set[int] = set()
    first = [s.pointer for s in walk(schema, seen=seen)]
    assert first == ["", "/anyOf/0", "/anyOf/1"]  # the second meeting skipped
    assert list(walk(shared, seen=seen)) == []


def test_nested_deeper_counts_json_levels():
    assert not nested_deeper(1, 1) and nested_deeper([1], 1) and not nested_deeper([1], 2)
    deep = []
    for _ in range(10_000):
        deep = [deep]
    assert nested_deeper(deep, 100)


def test_pointer_escapes():
    assert pointer(("a~b", "c/d", 3)) == "/a~0b/c~1d/3" and pointer(()) == ""


# --- the parsed schema on the spec -------------------------------------------------------------

def test_spec_keeps_its_parse_out_of_key_and_pickle():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = GrammarSpec.json_schema(schema)
    key = spec.key("tok")
    assert spec.parsed == schema
    assert spec.parsed is spec.parsed  # parsed once
    copy = pickle.loads(pickle.dumps(spec))
    assert "_parsed" not in copy.__dict__  # the text travels, not the object
    assert copy.parsed == schema and copy.key("tok") == key and copy == spec
    assert GrammarSpec.regex("a+").parsed is None
    assert GrammarSpec.choice(["x", "y"]).parsed == ["x", "y"]


def test_spec_refuses_remote_references_anywhere():
    with pytest.raises(ValueError, match=r"\$ref 'https://x' points outside the schema"):
        GrammarSpec.json_schema({"properties": {"a": {"$ref": "https://x"}}})
    with pytest.raises(ValueError, match=r"\$dynamicRef 'other.json' points outside"):
        GrammarSpec.json_schema({"x-vendor": {"$dynamicRef": "other.json"}})
    with pytest.raises(ValueError, match="points outside"):  # (even in data: as before)
        GrammarSpec.json_schema({"default": {"$ref": "https://x"}})
    deep = {}
    for _ in range(200):
        deep = {"items": deep}
    GrammarSpec.json_schema(deep)  # 201 objects deep: the most allowed
    with pytest.raises(ValueError, match="nested more than 200"):
        GrammarSpec.json_schema({"items": deep})


def test_later_stages_read_the_parse_not_the_text(monkeypatch):
    import json

    from grammar_cache.compile import _bad_pattern
    from worker.guided.shortest_bound import schema_counts
    from worker.guided.validation import approximated_keywords

    spec = GrammarSpec.json_schema({"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string", "pattern": "^[a-z]{2}$", "minLength": 2}}})

    def no_parse(*args, **kwargs):
        raise AssertionError("the schema text was parsed again")

    monkeypatch.setattr(json, "loads", no_parse)
    spec.check_repetitions(1000)
    assert schema_counts(spec.parsed)[0] > 0
    assert "pattern with minLength/maxLength" in approximated_keywords(spec.parsed)
    assert _bad_pattern(spec.parsed) is None
