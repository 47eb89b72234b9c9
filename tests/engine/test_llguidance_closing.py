"""Closing on llguidance succeeds wherever it does on xgrammar (issue 39): in a large
real-world-like schema (nested objects, shared definitions, many properties, strings with
patterns and formats), an output cut inside a deep string, and one cut back after a
repeating run there (what the loop guard does), closes within the budget on both engines,
and the closed text parses and validates against the schema. On the default model's
tokenizer; the searches get a generous time limit, so a busy machine does not decide."""

import json

import pytest

from core.grammar_spec import GrammarSpec
from worker.guided.guided_process import GuidedDecodingManager
from worker.guided.validation import validate_json

pytestmark = pytest.mark.integration

ADDRESS = {"type": "object", "properties": {
    "street": {"type": "string", "minLength": 3, "maxLength": 80},
    "city": {"type": "string"},
    "postal_code": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
    "country": {"type": "string", "enum": ["US", "CA", "MX", "DE", "FR"]},
    "geo": {"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180}},
        "required": ["lat", "lon"]}},
    "required": ["street", "city", "postal_code", "country"]}
PERSON = {"type": "object", "properties": {
    "id": {"type": "string", "format": "uuid"},
    "name": {"type": "string", "maxLength": 60},
    "email": {"type": "string", "format": "email"},
    "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,15}$"},
    "born": {"type": "string", "format": "date"},
    "updated": {"type": "string", "format": "date-time"},
    "address": {"$ref": "#/$defs/address"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
    "notes": {"type": "string"},
    "ref": {"type": "string", "pattern":  # JSONSchemaBench's Snowplow schemas
            "^iglu:[a-zA-Z0-9-_.]+/[a-zA-Z0-9-_]+/[a-zA-Z0-9-_]+/[0-9]+-[0-9]+-[0-9]+$"}},
    "required": ["id", "name", "email", "address", "notes", "ref"]}
SCHEMA = {"$defs": {"address": ADDRESS, "person": PERSON}, "type": "object", "properties": {
    "company": {"type": "object", "properties": {
        "name": {"type": "string"},
        "website": {"type": "string", "format": "uri"},
        "founded": {"type": "integer", "minimum": 1800, "maximum": 2100},
        "hq": {"$ref": "#/$defs/address"},
        "departments": {"type": "array", "items": {"type": "object", "properties": {
            "title": {"type": "string"}, "budget": {"type": "number"},
            "head": {"$ref": "#/$defs/person"},
            "members": {"type": "array", "items": {"$ref": "#/$defs/person"}}},
            "required": ["title", "head"]}}},
        "required": ["name", "hq", "departments"]},
    "summary": {"type": "string"}},
    "required": ["company", "summary"]}
ADA = {"id": "123e4567-e89b-12d3-a456-426614174000", "name": "Ada Lovelace",
       "email": "ada@example.com", "phone": "+4412345678", "born": "1815-12-10",
       "updated": "2024-02-22T12:30:00Z",
       "address": {"street": "12 St James's Square", "city": "London",
                   "postal_code": "10001", "country": "US", "geo": {"lat": 51.5, "lon": -0.13}},
       "tags": ["math", "engines"],
       "notes": "Wrote the first program for the Analytical Engine, and notes on it.",
       "ref": "iglu:com.acme/person/jsonschema/1-0-0"}
INSTANCE = {"company": {
    "name": "Analytical Engines Ltd", "website": "https://example.com/about", "founded": 1843,
    "hq": {"street": "1 Main Street", "city": "Springfield", "postal_code": "12345-6789",
           "country": "CA"},
    "departments": [{"title": "Research", "budget": 1250000.5, "head": ADA, "members": [ADA]}]},
    "summary": "A company that builds engines and writes the programs that run on them."}
BUDGETS = (24, 48)
# deep strings, free text and a pattern's fields: the text each cut follows, and a
# repeating run there that the loop guard would cut back. Not cut earlier in Ada's record
# (her name, her street): what the schema still requires there is longer than either
# budget, so both engines' searches only ran out their time limit (16 of them, 32 s of the
# suite) and decided nothing
TEXT_RUN, FIELD_RUN = " the end" * 5, "-json" * 5
CUTS = (('"notes": "Wrote the first program for', TEXT_RUN),
        ('"summary": "A company that builds', TEXT_RUN),
        ('"ref": "iglu:com.acme', FIELD_RUN), ('"ref": "iglu:com.acme/person/json', FIELD_RUN))


@pytest.fixture(scope="module")
def setup(default_tokenizer):
    tok = default_tokenizer
    manager = GuidedDecodingManager.from_tokenizer(tok, len(tok), [tok.eos_token_id])
    manager.closer.time_limit_s = 2.0  # the verdicts, not the machine's load
    yield tok, manager
    manager.shutdown()


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def prefixes(tok):
    """(name, tokens fed, steps to roll back) per cut: the instance's text up to a place
    inside a deep string; the same with a repeating run added and rolled back."""
    text = json.dumps(INSTANCE)
    out = []
    for cut, repeating in CUTS:
        head = text[:text.index(cut) + len(cut)]
        ids = encode(tok, head)
        out.append((cut, ids, 0))
        run = encode(tok, head + repeating)
        assert run[:len(ids) - 1] == ids[:len(ids) - 1]
        out.append((cut + " (loop cut)", run, len(run) - len(ids) + 1))
    return out


def close(tok, manager, engine, ids, back, budget):
    compiled = manager.get_grammar(GrammarSpec.json_schema(SCHEMA, engine=engine)).result(
        timeout=120)
    assert compiled.engine == engine
    m = manager.new_matcher(compiled)
    assert all(m.accept_token(t) for t in ids)
    if back:
        m.rollback(back)
        ids = ids[:len(ids) - back]
    found = manager.closer.fitting(m, budget)
    if found.tokens is None or len(found.tokens) > budget:
        return None
    probe = m.fork()
    assert all(probe.accept_token(t) for t in found.tokens) and probe.is_completed()
    return tok.decode(ids + found.tokens)


def test_closing_on_llguidance_succeeds_wherever_xgrammar_does(setup):
    tok, manager = setup
    missed, invalid, closed = [], [], []
    for name, ids, back in prefixes(tok):
        for budget in BUDGETS:
            outputs = {engine: close(tok, manager, engine, ids, back, budget)
                       for engine in ("xgrammar", "llguidance")}
            if outputs["xgrammar"] is not None and outputs["llguidance"] is None:
                missed.append((name, budget))
            for engine, text in outputs.items():
                if text is not None:
                    closed.append((engine, name, budget))
                    try:
                        json.loads(text)
                        error = validate_json(SCHEMA, text)
                    except ValueError as exc:
                        error = str(exc)
                    if error is not None:
                        invalid.append((engine, name, budget, error, text[-80:]))
    assert not invalid
    assert not missed
    # the verdicts above are about closings that happened: at the larger budget every cut
    # closes on both engines
    assert {(e, n) for e, n, b in closed if b == max(BUDGETS)} == {
        (e, n) for e in ("xgrammar", "llguidance") for n, _, _ in prefixes(tok)}
