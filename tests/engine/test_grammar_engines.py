"""Both grammar engines (worker/guided/) on the default model's real
tokenizer: a schema's valid instance accepted token by token and invalid ones refused,
stop tokens, rollback and fork, the masks of the two engines against each other, one
error vocabulary, strict mode on llguidance, and the ``auto`` rule."""

import json
import pickle

import pytest
import torch
import xgrammar as xgr

from core.errors import ErrorKind, GrammarError
from core.grammar_spec import GrammarSpec
from worker.guided.backend import (AUTO, BACKENDS, LLGUIDANCE, XGRAMMAR, EngineRefused,
                                   auto_backend, backends_for, compile_auto)
from worker.guided.schema_options import strict_schema
from worker.guided.schema_rewrites import exact_rewrites

pytestmark = pytest.mark.integration  # the tokenizer comes from the converted default model

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "age"]}
VALID = {"name": "Ada", "age": 36, "tags": ["a", "b"]}
INVALID = [{"name": "Ada"},                               # a required property missing
           {"name": "Ada", "age": -1},                    # under the minimum
           {"name": "Ada", "age": 36, "tags": ["c"]},     # not in the enum
           {"name": "Ada", "age": 36, "extra": 1}]        # strict: no other properties
NOT_SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "not": {"const": "x"}}}}


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer


@pytest.fixture(scope="module")
def engines(tokenizer):
    return backends_for(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def feed(matcher, tokens) -> bool:
    return all(matcher.accept_token(t) for t in tokens)


def allowed(engines, matcher) -> set[int]:
    mask = xgr.allocate_token_bitmask(2, engines[XGRAMMAR].vocab_size)
    mask.zero_()
    matcher.fill_bitmask(mask, 1)
    bits = (mask[1].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()).flatten().tolist())


@pytest.mark.parametrize("name", BACKENDS)
def test_valid_instance_accepted_then_stop(engines, tokenizer, name):
    engine = engines[name]
    m = engine.matcher(engine.compile(GrammarSpec.json_schema(PERSON)))
    assert feed(m, ids(tokenizer, json.dumps(VALID)))
    assert m.is_completed() and not m.is_terminated()
    assert m.accept_token(tokenizer.eos_token_id)
    assert m.is_terminated()
    assert not m.accept_token(ids(tokenizer, " ")[0])


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("instance", INVALID)
def test_invalid_instance_refused(engines, tokenizer, name, instance):
    engine = engines[name]
    m = engine.matcher(engine.compile(GrammarSpec.json_schema(PERSON)))
    ok = feed(m, ids(tokenizer, json.dumps(instance)))
    assert not (ok and m.accept_token(tokenizer.eos_token_id))


@pytest.mark.parametrize("name", BACKENDS)
def test_refused_token_leaves_matcher_usable(engines, tokenizer, name):
    engine = engines[name]
    m = engine.matcher(engine.compile(GrammarSpec.json_schema(PERSON)))
    assert not m.accept_token(ids(tokenizer, "]")[0])
    assert not m.accept_token(tokenizer.eos_token_id)  # the grammar may not end here
    assert feed(m, ids(tokenizer, json.dumps(VALID)))


@pytest.mark.parametrize("name", BACKENDS)
def test_rollback_and_fork(engines, tokenizer, name):
    engine = engines[name]
    m = engine.matcher(engine.compile(GrammarSpec.json_schema(PERSON)))
    tokens = ids(tokenizer, json.dumps(VALID))
    assert feed(m, tokens[:5])
    before = allowed(engines, m)
    twin = m.fork()
    assert feed(m, tokens[5:]) and m.accept_token(tokenizer.eos_token_id)
    assert allowed(engines, twin) == before  # the fork did not move
    m.rollback(1)  # the stop token
    assert not m.is_terminated() and m.is_completed()
    m.rollback(len(tokens) - 5)
    assert allowed(engines, m) == before
    assert feed(twin, tokens[5:]) and twin.is_completed()


@pytest.mark.parametrize("name", BACKENDS)
def test_forced_continuation(engines, name):
    engine = engines[name]
    m = engine.matcher(engine.compile(GrammarSpec.json_schema(PERSON)))
    assert m.forced_continuation() == '{"name": "'


def test_masks_agree(engines, tokenizer):
    """Step by step along a valid instance: llguidance's mask is xgrammar's less special
    tokens, raw DEL (U+007F, which JSON allows in a string and llguidance does not) and
    the tokens that cover only part of a forced text; the same where nothing is forced. (Not on PERSON: xgrammar writes a string with maxLength without escapes.)"""
    simple = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}}}
    spec = GrammarSpec.json_schema(simple)
    xm, lm = (engines[n].matcher(engines[n].compile(spec)) for n in (XGRAMMAR, LLGUIDANCE))
    exempt = set(tokenizer.all_special_ids) | {
        t for t, piece in enumerate(tokenizer.convert_ids_to_tokens(range(len(tokenizer))))
        if piece.startswith("<") and piece.endswith(">") and len(piece) > 2
        or "\x7f" in tokenizer.decode([t])}
    free_steps = 0
    for token in ids(tokenizer, json.dumps({"name": "Ada", "age": 36})):
        x, ll = allowed(engines, xm), allowed(engines, lm)
        forced = xm.forced_continuation()
        assert ll <= x
        for t in x - ll - exempt:
            assert forced.startswith(tokenizer.decode([t])), (t, forced)
        if not forced:
            assert x - exempt == ll
            free_steps += 1
        assert xm.accept_token(token) and lm.accept_token(token)
    assert free_steps >= 3


def test_one_error_vocabulary(engines):
    bad = GrammarSpec.regex("a(b")
    for name in BACKENDS:
        with pytest.raises(EngineRefused) as info:
            engines[name].compile(bad)
        exc = info.value
        assert isinstance(exc, GrammarError) and isinstance(exc, ValueError)
        assert exc.engine == name and exc.kind is ErrorKind.INVALID_GRAMMAR
        again = pickle.loads(pickle.dumps(exc))
        assert (again.engine, str(again), again.kind) == (name, str(exc), exc.kind)
    with pytest.raises(EngineRefused, match="not"):
        engines[LLGUIDANCE].compile(GrammarSpec.json_schema(NOT_SCHEMA))
    with pytest.raises(EngineRefused, match="indent"):
        engines[LLGUIDANCE].compile(GrammarSpec.json_schema(PERSON, whitespace="indent"))
    with pytest.raises(EngineRefused, match="xgrammar"):
        engines[LLGUIDANCE].compile(GrammarSpec.ebnf('root ::= "a"'))


def test_llguidance_layouts(engines, tokenizer):
    engine = engines[LLGUIDANCE]
    for layout, text in [("compact", '{"name":"Ada","age":36}'),
                         ("spaced", '{"name": "Ada", "age": 36}'),
                         ("bounded", '{ "name" :  "Ada",\n "age": 36 }')]:
        m = engine.matcher(engine.compile(GrammarSpec.json_schema(PERSON, whitespace=layout)))
        assert feed(m, ids(tokenizer, text)) and m.is_completed(), layout
    m = engine.matcher(engine.compile(GrammarSpec.json_schema(PERSON, whitespace="compact")))
    assert not feed(m, ids(tokenizer, '{"name": "Ada"'))


def test_strict_is_optional_on_llguidance(engines, tokenizer):
    engine = engines[LLGUIDANCE]
    text = json.dumps({"name": "Ada", "age": 36, "extra": 1})
    lax = engine.matcher(engine.compile(GrammarSpec.json_schema(PERSON, strict=False)))
    assert feed(lax, ids(tokenizer, text)) and lax.is_completed()


def test_llguidance_state_key_tells_the_places_of_a_fixed_width_run_apart(engines, tokenizer):
    # llguidance exposes no parser state: inside a uuid's hex groups the mask and the
    # forced bytes repeat, and only the probe runs tell the places (and the groups) apart,
    # which the closing search needs to close a uuid (closing.py merges equal keys)
    engine = engines[LLGUIDANCE]
    compiled = engine.compile(GrammarSpec.json_schema(
        {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
                                          "s": {"type": "string"}},
         "required": ["id", "s"]}))

    def matcher(text):
        m = engine.matcher(compiled)
        assert m.accept_string(text), text
        return m

    head = '{"id": "12345678-1234-1234-1234-'
    places = [matcher(head + "1" * n).state_key() for n in range(12)]
    assert len(set(places)) == 12
    # the 12-digit group's place 3 before its end is not the 4-digit group's (that one
    # ends in "-", this one in a quote)
    assert matcher(head + "1" * 9).state_key() != matcher('{"id": "12345678-1').state_key()
    # free text: every place is one place
    tail = head + "1" * 12 + '", "s": "'
    assert matcher(tail + "ab").state_key() == matcher(tail + "abcdef").state_key()
    # asking moves nothing: the matcher goes on (and is keyed) as before
    m = matcher(head + "1" * 11)
    m.state_key()
    assert not feed(m, ids(tokenizer, "z")) and m.state_key() == places[11]
    assert feed(m, ids(tokenizer, '1", "s": ""}')) and m.is_completed()


def test_strict_schema_closes_only_what_stands_alone():
    closed = strict_schema({"properties": {"a": {"properties": {"b": {}}}},
                            "prefixItems": [{}]})
    assert closed["additionalProperties"] is False and closed["items"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    merged = strict_schema({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in s for s in merged["allOf"])
    beside = strict_schema({"properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}]})
    assert "additionalProperties" not in beside and \
        "additionalProperties" not in beside["anyOf"][0]
    union = strict_schema({"anyOf": [{"properties": {"b": {}}}]})
    assert union["anyOf"][0]["additionalProperties"] is False
    # a union inside a merged schema describes the value the merge does: it stays open
    nested = strict_schema({"properties": {"a": {}}, "allOf": [{"anyOf": [{"required": ["a"]},
                                                                          {"properties": {"b": {}}}]}]})
    assert "additionalProperties" not in nested["allOf"][0]["anyOf"][1]
    assert "additionalProperties" not in strict_schema(
        {"properties": {"a": {}}, "required": ["a", "b"]})
    assert strict_schema({"not": {"properties": {"a": {}}}}) == {
        "not": {"properties": {"a": {}}}}
    assert strict_schema({"properties": {"a": {}}, "additionalProperties": True})[
        "additionalProperties"] is True


def accepts(engines, tokenizer, spec, value) -> bool:
    engine = engines[LLGUIDANCE]
    m = engine.matcher(engine.compile(spec))
    return feed(m, ids(tokenizer, json.dumps(value))) and m.accept_token(
        tokenizer.eos_token_id)


def test_llguidance_ignores_a_custom_format_as_the_drafts_do(engines, tokenizer):
    custom = {"type": "object", "properties": {"body": {"type": "string", "format": "textarea"},
                                               "format": {"enum": ["byte"]}}}
    assert exact_rewrites(custom)["properties"] == {"body": {"type": "string"},
                                                    "format": {"enum": ["byte"]}}
    spec = GrammarSpec.json_schema(custom)
    assert accepts(engines, tokenizer, spec, {"body": "any text", "format": "byte"})
    assert not accepts(engines, tokenizer, spec, {"body": 1})
    # a format the drafts define and llguidance lacks stays refused (xgrammar checks it)
    with pytest.raises(EngineRefused, match="uri-reference"):
        engines[LLGUIDANCE].compile(GrammarSpec.json_schema(
            {"type": "string", "format": "uri-reference"}))


@pytest.mark.parametrize("keyword", ["dependencies", "dependentRequired", "dependentSchemas"])
def test_llguidance_enforces_dependencies_exactly(engines, tokenizer, keyword):
    props = {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}
    dep = {"required": ["b"]} if keyword == "dependentSchemas" else ["b"]
    schema = {"type": "object", "properties": props, keyword: {"a": dep}}
    spec = GrammarSpec.json_schema(schema)
    assert engines[LLGUIDANCE].compile(spec).engine == LLGUIDANCE  # refused before
    for value, valid in [({"a": 1, "b": 2}, True), ({"b": 2, "c": 3}, True), ({}, True),
                         ({"a": 1}, False), ({"a": 1, "c": 3}, False),
                         # strict closes the object where the dependency is a list of
                         # names (a schema may declare more properties: left open)
                         ({"a": 1, "b": 2, "d": 4}, keyword == "dependentSchemas")]:
        assert accepts(engines, tokenizer, spec, value) is valid, value
    assert accepts(engines, tokenizer, GrammarSpec.json_schema(schema, strict=False),
                   {"a": 1, "b": 2, "d": 4})


def test_auto_rule():
    plain = GrammarSpec.json_schema(PERSON)
    refusal = EngineRefused(LLGUIDANCE, "llguidance refused it")
    assert auto_backend(plain, None) == LLGUIDANCE
    assert auto_backend(plain, refusal) == XGRAMMAR
    assert auto_backend(GrammarSpec.json_object(), None) == LLGUIDANCE
    assert auto_backend(GrammarSpec.regex("a+"), None) == XGRAMMAR  # JSON kinds only
    assert AUTO == "auto"


def test_compile_auto(engines):
    assert compile_auto(engines, GrammarSpec.json_schema(PERSON)).engine == LLGUIDANCE
    assert compile_auto(engines, GrammarSpec.json_schema(NOT_SCHEMA)).engine == XGRAMMAR
    assert compile_auto(engines, GrammarSpec.ebnf('root ::= "a"')).engine == XGRAMMAR
    with pytest.raises(EngineRefused) as info:
        compile_auto(engines, GrammarSpec.regex("a(b"))
    assert info.value.engine == XGRAMMAR
