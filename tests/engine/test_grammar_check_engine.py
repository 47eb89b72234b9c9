"""The grammar check on one engine, no Ray (worker/guided/grammar_check.py): its report is
what the engine's requests then meet, on the default model, for schemas it calls
refused, approximated and exact; and a request after a check compiles nothing."""

import json

import pytest

from core.grammar_spec import GrammarSpec
from worker.guided.grammar_check import GrammarChecker
from worker.engine.sampling import SamplingParams
from core.request import GenerationRequest

pytestmark = pytest.mark.integration

SCHEMAS = {
    "exact": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0}}, "required": ["city", "population"]},
    "exact_uuid": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}},
                   "required": ["id"]},
    "approximated": {"type": "object", "properties": {"xs": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}},
        "required": ["xs"]},
    "refused": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}},
}


def chat(text):
    return [{"role": "user", "content": text}]


def run(engine, spec, max_tokens, seed=1):
    req = GenerationRequest(chat("Answer with JSON."), SamplingParams(
        max_new_tokens=max_tokens, temperature=1.0, seed=seed), grammar=spec)
    return engine.generate([req])[req.request_id]


def test_predictions_hold_on_the_engine(make_engine):
    engine = make_engine()
    checker = GrammarChecker(engine.guided)
    for name, schema in SCHEMAS.items():
        spec = GrammarSpec.json_schema(schema)
        report = checker.check(spec).as_dict()
        assert report["status"] == name.split("_")[0], (name, report)
        if report["status"] == "refused":
            out = run(engine, spec, 32)
            assert out.finish_reason == "error" and out.error_kind.value == \
                report["error"]["code"], (name, out)
            continue
        short = report["shortest_output"]
        misses = engine.guided.stats.misses
        for budget, seed in ((short["tokens"], 1), (short["tokens"], 2), (48, 3)):
            out = run(engine, spec, budget, seed)
            assert out.finish_reason in ("stop", "length"), (name, budget, out.error)
            assert out.grammar_engine == report["engine"]
            assert list(out.approximated) == report["approximated"]
            assert out.completion_tokens >= short["at_least"], (name, out.completion_tokens)
            if report["status"] == "exact":
                assert out.validation == "valid", (name, budget, out.text)
                json.loads(out.text)
        assert engine.guided.stats.misses == misses  # the check compiled it for them
        if short["at_least"] > 1:  # under the bound: refused before generating
            out = run(engine, spec, short["at_least"] - 1)
            assert out.error_kind.value == "budget_too_small", (name, out)
