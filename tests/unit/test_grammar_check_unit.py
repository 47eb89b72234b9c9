"""The grammar check's pure parts (issue 42): keyword paths, grammar ids, the checked
grammars' bound, and the edge's reading of a check body and of ``grammar_id``."""

import pytest

from deploy import openai_api as api
from deploy.errors import APIError
from deploy.settings import Limits
from core.grammar_spec import grammar_id, is_grammar_id
from grammar_cache.checked import CheckedGrammars
from core.grammar_spec import GrammarSpec
from worker.guided.grammar_check import approximated_paths, refused_paths
from worker.guided.validation import approximated_keywords

pytestmark = pytest.mark.unit

SCHEMA = {"type": "object", "properties": {
    "tags": {"type": "array", "uniqueItems": True, "items": {"type": "string"}},
    "allOf": {"type": "string", "format": "custom-thing"},  # a property named allOf
    "nested": {"type": "object", "properties": {"n": {"not": {"type": "string"}}}}},
    "$defs": {"D": {"oneOf": [{"type": "integer"}, {"type": "string",
                                                    "pattern": "(^a)+"}]}},
    "enum": ["allOf"]}


def test_approximated_paths_name_each_keyword_where_it_is():
    found = {(k["path"], k["keyword"]) for k in approximated_paths(SCHEMA)}
    assert found == {("/properties/tags", "uniqueItems"),
                     ("/properties/allOf", "format: custom-thing (not checked)"),
                     ("/properties/nested/properties/n", "not"),
                     ("/$defs/D", "oneOf"),
                     ("/$defs/D/oneOf/1", "pattern without ^...$ anchors")}
    # the same keywords as the responses' guided.approximated, only placed
    assert sorted({k for _, k in found}) == approximated_keywords(SCHEMA)


def test_refused_paths_read_llguidance_s_unimplemented_keys():
    message = 'invalid json_schema grammar for llguidance: Unimplemented keys: ["uniqueItems"]'
    assert refused_paths(SCHEMA, message) == [{"path": "/properties/tags",
                                               "keyword": "uniqueItems"}]
    assert refused_paths(SCHEMA, "regex parse error:") == []
    assert refused_paths(None, message) == []
    # a pointer escapes "/" and "~" in names
    odd = {"properties": {"a/b~c": {"uniqueItems": True}}}
    assert refused_paths(odd, message)[0]["path"] == "/properties/a~1b~0c"


def test_grammar_ids_are_stable_and_tell_specs_apart():
    a = GrammarSpec.json_schema({"type": "object"})
    assert grammar_id(a) == grammar_id(GrammarSpec.json_schema('{"type": "object"}'))
    assert grammar_id(a) == "grammar-" + a.key("")
    forced = GrammarSpec.json_schema({"type": "object"}, engine="xgrammar")
    assert grammar_id(forced) != grammar_id(a)
    assert is_grammar_id(grammar_id(a))
    for bad in ("grammar-", "grammar-" + "g" * 32, "x" + grammar_id(a), None, 3):
        assert not is_grammar_id(bad)


def test_checked_grammars_keep_the_newest_within_their_bytes():
    specs = [GrammarSpec.regex("a" * 100 + str(i)) for i in range(10)]
    checked = CheckedGrammars(max_bytes=2000, owner_bytes=2000)
    for spec in specs:
        checked.put("c", grammar_id(spec), spec, {"id": grammar_id(spec)})
    assert checked.get("c", grammar_id(specs[-1]))[0] == specs[-1]
    assert checked.get("c", grammar_id(specs[0])) is None
    assert checked.bytes <= 2000 and 1 <= len(checked) < 10
    big = GrammarSpec.regex("b" * 5000)  # over the bound alone: still kept, as the newest
    checked.put("c", grammar_id(big), big, {})
    assert len(checked) == 1 and checked.get("c", grammar_id(big)) is not None


def test_a_checked_grammar_is_its_owner_s_alone():
    """Another client naming the id finds nothing (it learns nothing of what was checked:
    it checks the grammar itself), and the owner's report is unchanged by it."""
    spec = GrammarSpec.regex("[a-z]+")
    checked = CheckedGrammars()
    checked.put("alice", grammar_id(spec), spec, {"id": grammar_id(spec), "status": "x"})
    assert checked.get("mallory", grammar_id(spec)) is None
    assert checked.get(None, grammar_id(spec)) is None
    assert checked.get("alice", grammar_id(spec)) == (spec, {"id": grammar_id(spec),
                                                           "status": "x"})


def test_a_flooding_client_evicts_only_its_own_checked_grammars():
    """One client checking grammar after grammar fills its own share (owner_bytes) and
    then the whole store's bound, and is the one evicted every time: every other
    client's ids stay."""
    checked = CheckedGrammars(max_bytes=40_000, owner_bytes=10_000)
    polite = [GrammarSpec.regex(f"polite{i}[a-z]{{{i + 1}}}") for i in range(5)]
    for spec in polite:
        checked.put("polite", grammar_id(spec), spec, {"id": grammar_id(spec)})
    for i in range(2000):
        spec = GrammarSpec.regex(f"flood{i}" + "x" * 500)
        checked.put("flood", grammar_id(spec), spec, {"id": grammar_id(spec)})
        assert checked.bytes <= 40_000 and checked.held("flood") <= 10_000
    for spec in polite:
        assert checked.get("polite", grammar_id(spec)) is not None
    # many flooding identities at once: the store stays within its bound, the heaviest
    # owners evicted first
    for i in range(200):
        spec = GrammarSpec.regex(f"many{i}" + "y" * 2000)
        checked.put(f"user{i}", grammar_id(spec), spec, {"id": grammar_id(spec)})
        assert checked.bytes <= 40_000


def test_checked_grammars_count_what_they_really_hold():
    """The bytes counted are the bytes kept: the spec's parsed schema (a Python object
    many times its text) is not kept, and a large report counts as large."""
    import pickle

    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                               for i in range(2000)}}
    spec = GrammarSpec.json_schema(schema)
    assert spec.parsed is not None  # parsed at the edge, as a checked spec is
    report = {"id": grammar_id(spec), "engines": {"xgrammar": {"keywords": [
        {"path": f"/properties/p{i}", "keyword": "x"} for i in range(2000)]}}}
    checked = CheckedGrammars()
    checked.put("c", grammar_id(spec), spec, report)
    kept = pickle.dumps((spec, report), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(kept) <= checked.bytes <= len(kept) + 1024
    assert checked.bytes > len(spec.source) + 2000 * 20  # the report's keywords count
    again, report_again = checked.get("c", grammar_id(spec))
    assert again == spec and report_again == report


def body(**fields):
    return api.parse_request(api.GrammarCheckRequest, fields)


def test_check_body_reads_as_a_request_would():
    limits = Limits()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    spec = api.check_spec(body(response_format=rf), limits)
    assert spec == GrammarSpec.json_schema(schema)
    # a whole chat body is accepted; its non-grammar fields are read and left alone
    whole = body(messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                 response_format=rf, guided_decoding_backend="xgrammar")
    assert api.check_spec(whole, limits).engine == "xgrammar"
    assert api.check_spec(body(guided_regex="[0-9]+"), limits).kind == "regex"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert api.check_spec(body(tools=tools, tool_choice="required"),
                          limits).kind == "structural_tag"
    with pytest.raises(APIError) as caught:
        api.check_spec(body(temperature=0.2), limits)
    assert caught.value.status == 400 and "no grammar to check" in caught.value.message
    with pytest.raises(APIError) as caught:
        api.check_spec(body(tools=tools, tool_choice="required", guided_regex="a"), limits)
    assert caught.value.param == "tools"
    with pytest.raises(APIError) as caught:
        body(typo=1)
    assert caught.value.status == 400


def test_grammar_id_in_a_request():
    limits = Limits()
    spec = GrammarSpec.regex("[a-z]+")
    gid = grammar_id(spec)
    chat = dict(messages=[{"role": "user", "content": "x"}], grammar_id=gid)
    req = api.parse_request(api.ChatCompletionRequest, chat)
    assert api.plan_chat(req, limits, named=spec).grammar == spec
    with pytest.raises(APIError) as caught:  # the edge found nothing under the id
        api.plan_chat(req, limits, named=None)
    assert caught.value.status == 404 and caught.value.code == "grammar_not_found"
    for bad in ({"grammar_id": "x"}, {"grammar_id": gid, "guided_regex": "a"}):
        req = api.parse_request(api.ChatCompletionRequest, {**chat, **bad})
        with pytest.raises(APIError) as caught:
            api.plan_chat(req, limits, named=spec)
        assert caught.value.status == 400 and caught.value.param == "grammar_id"
    comp = api.parse_request(api.CompletionRequest, {"prompt": "x", "grammar_id": gid})
    assert api.plan_completion(comp, limits, named=spec).grammar == spec
    # an engine named beside the id applies, as beside any grammar
    req = api.parse_request(api.ChatCompletionRequest,
                            {**chat, "guided_decoding_backend": "llguidance"})
    assert api.plan_chat(req, limits, named=spec).grammar.engine == "llguidance"
