"""JSON grammars close from their schema (worker/guided/json_closing.py), with no search on
the engine thread (issue 56): a long required answer at a budget near its shortest output
ends valid even where every search would take seconds, and the rows beside it never wait
on one. The tiny model, scripted to ramble inside strings (the real-world failure: a
string filled until the budget ran out)."""

import json
import time

import jsonschema
import pytest

from core.grammar_spec import GrammarSpec
from core.params import LoopGuardParams
from core.request import GenerationRequest
from tests.engine.test_closing_long_engine import rambling_after_script
from worker.engine.sampling import SamplingParams
from worker.guided import closing

pytestmark = pytest.mark.integration

LONG_STRINGS = {"type": "object", "properties": {"lines": {
    "type": "array", "minItems": 16, "items": {"type": "string", "minLength": 24}}},
    "required": ["lines"]}
LONG_OBJECTS = {"type": "object", "properties": {"items": {
    "type": "array", "minItems": 6, "items": {
        "type": "object", "properties": {k: {"type": "string", "minLength": 24}
                                         for k in ("name", "detail", "source")},
        "required": ["name", "detail", "source"]}}}, "required": ["items"]}


def slowed(monkeypatch, seconds: float) -> list:
    """Every closing search takes ``seconds`` more (a slowed backend); returns the calls."""
    calls = []
    for name in ("shortest", "fitting", "estimate"):
        original = getattr(closing.CompletionSearch, name)

        def slow(self, *a, _original=original, _name=name, **k):
            calls.append(_name)
            time.sleep(seconds)
            return _original(self, *a, **k)
        monkeypatch.setattr(closing.CompletionSearch, name, slow)
    return calls


def request(schema, budget, engine_name):
    return GenerationRequest([{"role": "user", "content": "go"}],
                             SamplingParams(max_new_tokens=budget, temperature=0.0),
                             grammar=GrammarSpec.json_schema(schema, engine=engine_name),
                             loop_guard=LoopGuardParams(enabled=False))


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_long_required_answers_close_valid_with_every_search_slowed(
        make_tiny_engine, monkeypatch, engine_name):
    engine = make_tiny_engine()
    rambling_after_script(engine, "")
    calls = slowed(monkeypatch, 5.0)
    reqs = []
    for schema in (LONG_STRINGS, LONG_OBJECTS):
        text = json.dumps(next(iter([_witness(schema)])))
        shortest = len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
        reqs += [request(schema, int(shortest * 1.2) + 8, engine_name) for _ in range(2)]
    outs = engine.generate(reqs)
    for r in reqs:
        out = outs[r.request_id]
        schema = LONG_STRINGS if "lines" in r.grammar.source else LONG_OBJECTS
        jsonschema.validate(json.loads(out.text), schema)
        assert out.completion_tokens <= r.params.max_new_tokens
    assert calls == []  # no search ran: nothing could hold the batch
    assert engine.guide.policy.stats.closing_schema >= len(reqs)


def test_without_the_schema_closer_the_same_answers_search(make_tiny_engine, monkeypatch):
    """The other side: with ``schema_closing`` off the searches are what closes (and what
    the slowed backend would cost every row)."""
    engine = make_tiny_engine(schema_closing=False)
    rambling_after_script(engine, "")
    calls = slowed(monkeypatch, 0.0)
    engine.generate([request(LONG_STRINGS, 120, "llguidance")])
    assert calls


def _witness(schema):
    from worker.guided.schema_witness import witness
    return witness(schema)
