"""Both grammar engines through the real engine (issue 30): the tiny random-weight model
with the default model's tokenizer, so outputs wander until the grammar or the budget
ends them, which is what exercises closing. Each test runs per engine; a mixed batch
holds rows of both in one step."""

import json
import re

import pytest

from core.errors import ErrorKind
from core.grammar_spec import GrammarSpec
from worker.engine.sampling import SamplingParams
from core.request import GenerationRequest
from worker.guided.validation import validate_json

pytestmark = pytest.mark.integration

ENGINES = ["xgrammar", "llguidance"]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2}},
    "required": ["name", "age", "tags"]}
ZIP = {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
       "required": ["zip"]}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_model_dir), progress=False,
                                  num_kv_blocks=256, grammar_engine="auto"))


def request(spec, max_tokens, seed=0, **kw):
    return GenerationRequest("Describe a person as JSON:", SamplingParams(
        max_new_tokens=max_tokens, temperature=1.0, seed=seed, **kw), grammar=spec)


def run(engine, reqs):
    out = engine.generate(reqs)
    return [out[r.request_id] for r in reqs]


@pytest.mark.parametrize("name", ENGINES)
def test_closing_search_finds_a_completion_on_each_engine(engine, name):
    """The search alone, from mid-string and mid-pattern: a path that the real matcher
    accepts and that completes the grammar (fails if either engine's closing breaks)."""
    tok = engine.tokenizer
    for schema, prefix in ((PERSON, '{"name": "Al'), (ZIP, '{"zip": "1')):
        compiled = engine.guided.get_grammar(
            GrammarSpec.json_schema(schema, engine=name)).result(timeout=60)
        assert compiled.engine == name
        matcher = engine.guided.new_matcher(compiled)
        for t in tok(prefix, add_special_tokens=False)["input_ids"]:
            assert matcher.accept_token(t)
        found = engine.guided.closer.fitting(matcher, 40)
        assert found.tokens, (name, prefix)
        probe = matcher.fork()
        assert all(probe.accept_token(t) for t in found.tokens) and probe.is_completed()
        text = prefix + tok.decode(found.tokens)
        assert validate_json(json.dumps(schema), text) is None, text


@pytest.mark.parametrize("name", ENGINES)
def test_outputs_cut_by_the_budget_close_valid_on_each_engine(engine, name):
    spec = GrammarSpec.json_schema(PERSON, engine=name)
    outs = run(engine, [request(spec, 28, seed=i) for i in range(4)])
    for out in outs:
        assert out.finish_reason in ("stop", "length"), out.error
        assert out.grammar_engine == name
        json.loads(out.text)
        assert out.validation == "valid", (out.text, out.validation_error)
    assert any(out.closed_early for out in outs)  # the random model runs into its budget


def test_a_mixed_batch_serves_each_row_on_its_engine(engine):
    before = engine.guided.stats.as_dict()
    specs = [GrammarSpec.json_schema(PERSON, engine="xgrammar"),
             GrammarSpec.json_schema(PERSON, engine="llguidance"),
             GrammarSpec.regex("[a-z]{3}-[0-9]{2}", engine="llguidance"),
             GrammarSpec.regex("[a-z]{3}-[0-9]{2}"),  # auto: a regex stays on xgrammar
             GrammarSpec.json_schema(ZIP)]  # auto: a JSON schema llguidance takes
    want = ["xgrammar", "llguidance", "llguidance", "xgrammar", "llguidance"]
    reqs = [request(spec, 40, seed=i) for i, spec in enumerate(specs)]
    for r in reqs:
        engine.add_request(r)
    mixed_steps = 0
    outs = {r.request_id: None for r in reqs}
    while engine.has_work():
        guides = [engine.seqs[r.request_id].guide for r in reqs if r.request_id in engine.seqs]
        live = {g.matcher.engine for g in guides if g.matcher is not None}
        mixed_steps += live == {"xgrammar", "llguidance"}
        for chunk in engine.step():
            if outs[chunk.request_id] is None:
                outs[chunk.request_id] = chunk
            else:
                outs[chunk.request_id].merge(chunk)
    assert mixed_steps > 0  # one step's bitmask had rows of both engines
    for r, engine_name, spec in zip(reqs, want, specs):
        out = outs[r.request_id]
        assert out.finish_reason in ("stop", "length"), out.error
        assert out.grammar_engine == engine_name, spec
        if spec.kind == "regex":
            assert re.fullmatch(spec.source, out.text), out.text
        else:
            assert out.validation == "valid", out.text
    after = engine.guided.stats.as_dict()
    assert after["llguidance_requests"] - before["llguidance_requests"] == 3
    assert after["xgrammar_requests"] - before["xgrammar_requests"] == 2
    assert engine.stats().grammar_cache["llguidance_requests"] == after["llguidance_requests"]


def test_forcing_llguidance_on_a_grammar_it_refuses_fails_naming_it(engine):
    # (a "not" with no exact rewrite: "not a string" would be taken as the other types)
    negated = {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}},
               "required": ["a"]}
    forced, auto = run(engine, [request(GrammarSpec.json_schema(negated, engine="llguidance"), 16),
                                request(GrammarSpec.json_schema(negated), 16)])
    assert forced.finish_reason == "error" and forced.error_kind == ErrorKind.INVALID_GRAMMAR
    assert "llguidance" in forced.error
    # auto: llguidance refuses it, xgrammar approximates it (and says so)
    assert auto.finish_reason in ("stop", "length") and auto.grammar_engine == "xgrammar"
    assert "not" in auto.approximated
    ebnf = run(engine, [request(GrammarSpec.ebnf('root ::= "a"', engine="llguidance"), 8)])[0]
    assert ebnf.finish_reason == "error" and "xgrammar" in ebnf.error


@pytest.mark.parametrize("name", ENGINES)
def test_stop_strings_and_the_loop_guard_run_on_each_engine(engine, name):
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"s": {"type": "string"}},
                                    "required": ["s"]}, engine=name)
    out = run(engine, [request(spec, 40, stop=['"}'])])[0]
    assert out.finish_reason in ("stop", "length"), out.error
    assert out.grammar_engine == name
    json.loads(out.text if out.text.endswith("}") else out.text + '"}')
