"""The loop guard watches numbers (issue 39): a number whose digits repeat one group of up
to 16 digits for ``number_digits`` (20) digits and two groups ends there, and the value
around it closes (or, where the schema wants more, a comma lets it go on). Numbers a
schema or the world writes (``1000000000``, ``0.3333333333333333``, Avogadro's
``602214076000000000000000``) stay whole. Detector on the real tokenizer (xgrammar matcher); engine tests on both
grammar engines with the scripted tiny model, as tests/engine/test_loop_guard.py does."""

import json
import re

import jsonschema
import pytest

from core.grammar_spec import GrammarSpec
from tests.engine.test_loop_guard import detect, scripted, vocab  # noqa: F401 (a fixture)
from core.params import LoopGuardParams
from worker.engine.sampling import SamplingParams
from core.request import GenerationRequest

pytestmark = pytest.mark.integration

ENGINES = ["xgrammar", "llguidance"]
CITY = {"type": "object", "properties": {
    "name": {"type": "string"}, "population": {"type": "integer"},
    "area_km2": {"type": "number"}}, "required": ["name", "population", "area_km2"],
    "additionalProperties": False}
CITY_AREA_FIRST = {**CITY, "properties": {k: CITY["properties"][k] for k in
                                          ("name", "area_km2", "population")}}
ONE_NUMBER = {"type": "object", "properties": {"x": {"type": "number"}},
              "required": ["x"], "additionalProperties": False}
NUMBERS = {"type": "object", "properties": {"xs": {"type": "array",
                                                   "items": {"type": "number"}}},
           "required": ["xs"], "additionalProperties": False}


@pytest.mark.parametrize("schema, text, kept", [
    # a required key still to come: a comma, and the object goes on
    (CITY, '{"name": "Lyon", "population": ' + "1" * 40,
     '{"name": "Lyon", "population": ' + "1" * 20 + ","),
    (ONE_NUMBER, '{"x": 0.' + "3" * 40, '{"x": 0.' + "3" * 20 + "}"),
    (ONE_NUMBER, '{"x": 4.' + "1234" * 10, '{"x": 4.' + "1234" * 5 + "}"),  # a group of 4
    (NUMBERS, '{"xs": [1.5, 2' + "0" * 40, '{"xs": [1.5, 2' + "0" * 20 + "]"),
    # a group of 11 (bench.clients, llguidance: an author's "born" ran to the budget)
    (ONE_NUMBER, '{"x": 9' + "00123456789" * 6, '{"x": 9' + ("00123456789" * 3)[:21] + "}"),
])
def test_a_number_whose_digits_repeat_is_ended(default_tokenizer, vocab, schema, text, kept):
    assert detect(default_tokenizer, vocab, schema, text) == kept


@pytest.mark.parametrize("text", [
    '{"x": 1000000000',
    '{"x": 0.3333333333333333',  # 1/3 as a double prints
    '{"x": 0.30000000000000004',
    '{"x": 602214076000000000000000',
    '{"x": 3.14159265358979323846264338327950288419716939937510',  # no repetition
    '{"x": 1' + "0" * 18 + "e1" + "0" * 18,  # each part under 20
])
def test_numbers_people_write_are_kept(default_tokenizer, vocab, text):
    assert detect(default_tokenizer, vocab, ONE_NUMBER, text) is None


def test_number_watching_can_be_turned_off(default_tokenizer, vocab):
    assert detect(default_tokenizer, vocab, ONE_NUMBER, '{"x": ' + "1" * 40,
                  LoopGuardParams(number_digits=0)) is None
    with pytest.raises(ValueError, match="number_digits"):
        LoopGuardParams(number_digits=-1)


def generate(engine, schema, name, max_tokens=200, **digits):
    req = GenerationRequest([{"role": "user", "content": "go"}],
                            SamplingParams(max_new_tokens=max_tokens, temperature=0.0),
                            grammar=GrammarSpec.json_schema(schema, engine=name, **digits))
    engine.add_request(req)
    chunks = []
    while engine.has_work():
        chunks += [o for o in engine.step() if o.request_id == req.request_id]
    assert chunks[-1].finished
    return chunks, chunks[-1]


NO_DIGIT_GUARDS = dict(max_int_digits=0, max_frac_digits=0, max_exp_digits=0)


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("guards", [True, False], ids=["digit-guards", "no-digit-guards"])
@pytest.mark.parametrize("number", ["1" * 300, "0." + "3" * 300])
def test_engine_ends_a_looping_number_on_each_engine(make_tiny_engine, name, guards, number):
    engine = make_tiny_engine()
    # the script runs out after the number: off it, the model prefers EOS, then closers;
    # the rest of the object is the model's to write, under the grammar
    scripted(engine, '{"name": "Lyon", "area_km2": ' + number)
    chunks, final = generate(engine, CITY_AREA_FIRST, name,
                             **({} if guards else NO_DIGIT_GUARDS))
    assert final.grammar_engine == name
    text = "".join(c.text for c in chunks)
    written = text.split('"area_km2": ')[1].split(",")[0]
    if guards:
        # both engines' grammars bound a number (15 integer digits, 10 in a fraction):
        # the number ends before the guard would see a loop
        assert final.loop_cuts == 0 and len(written) < 20, text
    else:  # the loop guard ends it
        assert final.loop_cuts == 1, text
        assert written == number[:22 if "." in number else 20], text
    assert final.completion_tokens < 120, text  # not run to its budget of 200
    assert final.finish_reason == "stop", text
    jsonschema.validate(json.loads(text), CITY)


FREE = {"type": "object", "properties": {"name": {"type": "string"}, "data": {}},
        "required": ["name", "data"], "additionalProperties": False}


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("data", ["1" * 300, "[2, {\"x\": 0." + "3" * 300])
def test_engine_bounds_a_number_in_an_untyped_value_on_each_engine(make_tiny_engine, name, data):
    # `data` has no type: llguidance's grammar had no digit guards there (the loop guard,
    # off here, was all that ended such a number); both engines' grammars bound it now
    engine = make_tiny_engine()
    scripted(engine, '{"name": "Lyon", "data": ' + data)
    req = GenerationRequest([{"role": "user", "content": "go"}],
                            SamplingParams(max_new_tokens=200, temperature=0.0),
                            grammar=GrammarSpec.json_schema(FREE, engine=name),
                            loop_guard=LoopGuardParams(enabled=False))
    engine.add_request(req)
    chunks = []
    while engine.has_work():
        chunks += [o for o in engine.step() if o.request_id == req.request_id]
    final = chunks[-1]
    text = "".join(c.text for c in chunks)
    assert final.grammar_engine == name
    if data.startswith("1"):  # a bare number: bounded, the document ends
        assert final.finish_reason == "stop" and final.completion_tokens < 80, text
    else:  # after the bounded fraction the scripted model runs a key of "}}}..." (no loop
        # guard here to cut it): closed at the budget, still valid
        assert final.finish_reason in ("stop", "length"), text
    assert max(len(run) for run in re.findall(r"[0-9]+", text)) <= 15, text
    jsonschema.validate(json.loads(text), FREE)
