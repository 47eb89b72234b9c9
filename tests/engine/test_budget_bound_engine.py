"""The budget refusal through the engine (output_policy.py, shortest_bound.py).

A JSON schema whose shortest output cannot fit the budget is refused at admission by the
structural lower bound, with no search; the bound stays under the real tokenizer's count
of instances xgrammar's grammar accepts; and a request whose budget the search cannot
decide searches a bounded number of times, not on every step of its batch."""

import json
import time

import pytest
import xgrammar as xgr

from grammar_cache.compile import compile_spec
from core.errors import ErrorKind
from core.grammar_spec import GrammarSpec
from tests.unit.test_budget_bound_unit import LONG, SHORTEST_AND_NAMES
from worker.engine.sampling import SamplingParams
from worker.guided import output_policy
from core.request import GenerationRequest
from worker.guided.shortest_bound import TokenCapacity, schema_counts

pytestmark = pytest.mark.integration

STORE = {"type": "object", "properties": {"store": {"type": "string"}},
         "required": ["store"], "additionalProperties": False}


def request(schema, max_tokens, **params):
    return GenerationRequest([{"role": "user", "content": "go"}],
                             SamplingParams(max_new_tokens=max_tokens, temperature=0.0,
                                            **params),
                             grammar=GrammarSpec.json_schema(json.dumps(schema)))


def run(engine, requests):
    outs = engine.generate(requests)
    return [outs[r.request_id] for r in requests]


@pytest.fixture(scope="module")
def vocab_info(default_tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(default_tokenizer, vocab_size=49152)
    return info, TokenCapacity(list(info.decoded_vocab))


@pytest.mark.parametrize("name, schema, instance", SHORTEST_AND_NAMES,
                         ids=[r[0] for r in SHORTEST_AND_NAMES])
@pytest.mark.parametrize("whitespace", ["spaced", "compact"])
def test_the_bound_stays_under_instances_the_grammar_accepts(default_tokenizer, vocab_info,
                                                             name, schema, instance,
                                                             whitespace):
    info, capacity = vocab_info
    if name == "no-type-any":
        pytest.skip("xgrammar reads properties without a type as an object; the instance "
                    "(any value) is llguidance's, which the unit test's bound covers")
    grammar = compile_spec(xgr.GrammarCompiler(info),
                           GrammarSpec.json_schema(json.dumps(schema), whitespace=whitespace))
    # a const or enum value keeps xgrammar's own layout (compact) in every mode
    texts = [json.dumps(instance), json.dumps(instance, separators=(",", ":"))]
    accepted = [t for t in texts if _accepts(grammar, t)]
    assert accepted, texts
    bound = capacity.bound(json.dumps(schema))  # both bounds (the literal texts' too)
    assert bound >= capacity.min_tokens(schema_counts(json.dumps(schema)))
    for text in accepted:
        assert bound <= len(default_tokenizer(text, add_special_tokens=False)["input_ids"])


def _accepts(grammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("max_tokens", [24, 48, 100])
def test_a_schema_far_over_the_budget_is_refused_without_a_search(make_engine, max_tokens):
    # 40 required objects: at least 135 tokens. The search used to give up on it (no
    # verdict), admit it, search again on its steps and answer invalid JSON with a 200;
    # outside the closing window nothing was checked at all
    engine = make_engine()
    searches = engine.guided.closer.stats["searches"]
    t = time.process_time()  # CPU time (the suite may run this beside other tests)
    outs = run(engine, [request(LONG, max_tokens) for _ in range(3)])
    cpu_s = time.process_time() - t
    for out in outs:
        assert out.error_kind == ErrorKind.BUDGET_TOO_SMALL, (out.error, out.text)
        # 135 from the characters, 202 from the names' tokens (40 x '"name"', '"biography"')
        assert f"needs at least 202 tokens, but max_tokens allows {max_tokens}" in out.error
        assert out.completion_tokens == 0
    assert engine.guided.closer.stats["searches"] == searches  # decided by the bound
    assert engine.guide.policy.stats.budget_checks == 3
    assert cpu_s < 5.0  # no search ran: one that gives up costs 0.1 s each


def test_a_schema_whose_bound_fits_is_still_admitted(make_engine):
    engine = make_engine()
    one = {**LONG, "properties": {"people": {**LONG["properties"]["people"], "minItems": 1}}}
    [out] = run(engine, [request(one, 48)])
    assert out.error is None and out.finish_reason in ("stop", "length")
    assert out.validation == "valid", out.text


def scripted(engine, text):
    """The model follows ``text`` while the output is a prefix of its tokens (then EOS)."""
    script = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = sorted(engine.eos_ids)[0]
    run_model = engine.runner.run

    def run_scripted(scheduled):
        logits, rows = run_model(scheduled)
        logits = logits.clone()
        for i, seq in enumerate(s.seq for s in scheduled if s.samples):
            out = seq.output_ids
            logits[i] = 0.0
            follow = out == script[:len(out)] and len(out) < len(script)
            logits[i, script[len(out)] if follow else eos] = 100.0
        return logits, rows

    engine.drafter = None  # its logits are scripted one row a sampling row: no drafts
    engine.runner.run = run_scripted


@pytest.mark.parametrize("rows", [1, 4])
def test_an_undecided_budget_does_not_search_on_every_step(make_tiny_engine, rows,
                                                           monkeypatch):
    # every search is cut short at once (no time): the budget is never decided. Admission
    # gives up once (its verdict is remembered for the other rows), then each row tries
    # again 4 and 20 tokens in, and stops: 2 searches in 40 steps, where it was 4 (after
    # 1, 2, 4 and 8 tokens) and the admission's give-up was forgotten
    # (no closing probe either: with its own time, its dive's path would close the output
    # where the searches give up, tests/engine/test_closing_fallback_engine.py)
    # (and no witness: the schema's own short instance would decide the budget at once,
    # test_a_witness_decides_a_budget_the_searches_cannot below)
    monkeypatch.setattr(output_policy, "start_witness", lambda *a: None)
    engine = make_tiny_engine(loop_guard=False, closing_probe_ms=0.0,  # it repeats itself
                              schema_closing=False)  # the searches (a schema closes unsearched)
    engine.guided.closer.time_limit_s = 0.0
    scripted(engine, '{"store": "' + "the market by the river, " * 30)
    searches = engine.guided.closer.stats["searches"]
    outs = run(engine, [request(STORE, 40) for _ in range(rows)])
    assert all(o.finish_reason == "length" and o.completion_tokens == 40 for o in outs), \
        [(o.finish_reason, o.completion_tokens, o.error) for o in outs]
    stats = engine.guide.policy.stats
    assert stats.closing_searches == 2 * rows
    assert stats.closing_giveups == 2 * rows
    # the admission's search: the dive, then a longer one (fitting, then shortest), once
    assert engine.guided.closer.stats["searches"] - searches == 2 + 2 * rows


UUIDS = {"type": "object", "properties": {
    "id": {"type": "string", "format": "uuid"}, "day": {"type": "string", "format": "date"}},
    "required": ["id", "day"], "additionalProperties": False}


def test_a_budget_the_check_predicted_is_admitted_on_a_busy_engine(make_engine):
    # the grammar check finds the shortest output (its searches have time); a request at
    # that budget, on an engine whose every search is now cut short at once (a busy
    # machine), is admitted with the path the check found, not refused on a search that
    # ran out of time (issue 42: the verdict depended on the time a search got)
    from worker.guided.grammar_check import GrammarChecker

    engine = make_engine()
    spec = GrammarSpec.json_schema(json.dumps(UUIDS))
    engine.guided.closer.time_limit_s = 30.0  # the check's searches finish on a busy machine
    shortest = GrammarChecker(engine.guided).check(spec).shortest_output["tokens"]
    assert shortest is not None and 20 < shortest <= engine.config.closing_window
    engine.guided.closer.time_limit_s = 0.0
    searches = engine.guided.closer.stats["searches"]
    [out] = run(engine, [request(UUIDS, shortest)])
    assert out.finish_reason in ("stop", "length") and out.error is None, out.error
    assert engine.guided.closer.stats["searches"] == searches  # no search at admission
    json.loads(out.text)
    assert out.validation == "valid", out.text


# Github_hard/o60179's shape: four required keys after many optional ones, two of them
# objects and lists of objects. The searches' dive takes every optional key (129 tokens
# on the real schema), the exact search runs out of nodes; a valid output of about 30
# tokens holds the required keys only
_ORG = {"type": "object", "properties": {"email": {"type": "string"},
                                         "name": {"type": "string"},
                                         "sameAs": {"type": "array",
                                                    "items": {"type": "string"}}},
        "required": ["name"]}
OPTIONAL_FIRST = {
    "type": "object", "definitions": {"org": _ORG},
    "properties": {
        "contributors": {"type": "array", "items": {"$ref": "#/definitions/org"}},
        **{f"note{i}": {"type": "string"} for i in range(8)},
        "publisher": {"anyOf": [{"$ref": "#/definitions/org"}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "title": {"type": "string"},
        "uris": {"type": "object", "properties": {
            "canonicalUri": {"type": "string", "format": "uri"},
            "other": {"type": "array", "items": {"type": "string"}}},
            "required": ["canonicalUri"]},
        "updated": {"type": "string", "format": "date-time"}},
    "required": ["title", "contributors", "uris", "updated"]}


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_a_witness_decides_a_budget_the_searches_cannot(make_tiny_engine, engine_name):
    """Every search is cut short at once (a busy engine). The grammar check still reports
    a shortest output: the schema's witness (schema_witness.py), replayed on the grammar.
    A fresh request at that budget, on this or a new engine, is admitted with it and
    answers valid; without the witness the check made no prediction and such a request
    was cut unclosed at the bench's guess (Github_hard/o60179)."""
    from worker.guided.grammar_check import GrammarChecker

    engine = make_tiny_engine(closing_probe_ms=0.0)
    engine.guided.closer.time_limit_s = 0.0
    spec = GrammarSpec.json_schema(json.dumps(OPTIONAL_FIRST), engine=engine_name)
    report = GrammarChecker(engine.guided).check(spec)
    assert report.engine == engine_name
    shortest = report.shortest_output["tokens"]
    assert shortest is not None and shortest <= 64, report.shortest_output
    searches = engine.guided.closer.stats["searches"]
    outs = run(engine, [GenerationRequest(
        [{"role": "user", "content": "go"}],
        SamplingParams(max_new_tokens=shortest, temperature=1.0, seed=s), grammar=spec)
        for s in range(3)])
    assert engine.guided.closer.stats["searches"] == searches  # no search at admission
    for out in outs:
        assert out.error is None and out.validation == "valid", (out.error, out.text)
        assert out.completion_tokens <= shortest
    fresh = make_tiny_engine(closing_probe_ms=0.0)  # no check ran here: admission builds it
    fresh.guided.closer.time_limit_s = 0.0
    [out] = run(fresh, [GenerationRequest(
        [{"role": "user", "content": "go"}],
        SamplingParams(max_new_tokens=shortest, temperature=0.0), grammar=spec)])
    assert out.error is None and out.validation == "valid", (out.error, out.text)


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_both_backends_spell_names_and_enum_strings_literally(make_tiny_engine, engine_name):
    """The literal texts' bound (shortest_bound.py) counts the tokens of a property's name
    and an enum string as they are spelt: it holds only if no backend takes an escaped
    spelling of them (which a tokenizer could cover otherwise)."""
    engine = make_tiny_engine()
    schema = {"type": "object", "properties": {"kind": {"enum": ["alpha", "beta"]}},
              "required": ["kind"], "additionalProperties": False}
    spec = GrammarSpec.json_schema(json.dumps(schema), engine=engine_name)
    compiled = engine.guided.get_grammar(spec).result(timeout=60)
    assert compiled.engine == engine_name

    def takes(text):
        matcher = engine.guided.new_matcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    assert takes('{"kind": "alpha"}') or takes('{"kind":"alpha"}')
    for escaped in ('{"\\u006bind": "alpha"}', '{"kind": "\\u0061lpha"}',
                    '{"\\u006bind":"alpha"}', '{"kind":"\\u0061lpha"}'):
        assert not takes(escaped), escaped


def test_many_long_names_are_refused_by_their_tokens(make_tiny_engine):
    """88 required camelCase names (Github_ultra/o21136 is such a schema): its outputs
    need far over 512 tokens, which the characters' bound (quotes, braces) does not show;
    the names' tokens do, and the request is refused before it generates instead of
    running to its budget unclosed."""
    names = [f"serviceProviderAssurance{w}Declaration" for w in (
        "Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel")]
    schema = {"type": "object", "properties": {
        f"{n}{i}": {"type": "boolean"} for n in names for i in range(11)},
        "required": [f"{n}{i}" for n in names for i in range(11)]}
    engine = make_tiny_engine()
    capacity = TokenCapacity(engine.guided.closer.vocab)
    assert capacity.min_tokens(schema_counts(schema)) < 512 < capacity.bound(schema)
    out, = run(engine, [request(schema, 512)])
    assert out.error_kind == ErrorKind.BUDGET_TOO_SMALL, (out.error, out.text)
    assert out.completion_tokens == 0 and "shortest output needs" in out.error
