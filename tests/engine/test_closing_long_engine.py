"""Budget-aware closing of an output whose completion is longer than twice the closing
window (issue 39: real-world schemas with many required properties came back unclosed at
their budget): the closing estimate is taken from the grammar's start at admission, so
closing begins in time; the probe at twice the window (96 tokens left) found a completion
longer than what was left. The tiny model, scripted (its logits are overwritten), where
the script decides the output; the default model where its own answer is what is covered."""

import json

import jsonschema
import pytest

from core.grammar_spec import GrammarSpec
from core.params import LoopGuardParams
from core.request import GenerationRequest
from tests.engine.test_loop_guard import generate, scripted
from worker.engine.sampling import SamplingParams

pytestmark = pytest.mark.integration

MANY_KEYS = {"type": "object", "properties": {
    "titles": {"type": "array", "items": {
        "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"],
        "additionalProperties": False}},
    **{f"required_property_number_{i}": {"type": "string"} for i in range(16)}},
    "required": ["titles"] + [f"required_property_number_{i}" for i in range(16)],
    "additionalProperties": False}


def test_a_completion_longer_than_twice_the_window_closes_in_time(make_tiny_engine):
    engine = make_tiny_engine()
    scripted(engine, '{"titles": [' + '{"title": "Titles"}, ' * 80)
    chunks, final = generate(engine, MANY_KEYS, max_tokens=300,
                             loop_guard=LoopGuardParams(enabled=False))
    text = "".join(c.text for c in chunks)
    jsonschema.validate(json.loads(text), MANY_KEYS)
    assert final.finish_reason == "length" and final.closed_early


def rambling_after_script(engine, text):
    """``scripted``, but off the script the model writes a new word on every step wherever
    a string allows one (a different word each time: nothing for the loop guard to cut):
    an answer that, cut back by the guard, fills its next string until the budget runs
    out, as the real-world ones did."""
    tok = engine.tokenizer
    script = tok(text, add_special_tokens=False)["input_ids"]
    words = [i for t, i in sorted(tok.get_vocab().items())
             if t.startswith("\u0120") and t[1:].isalpha() and t[1:].islower()
             and len(t) >= 7][:600]
    scripted(engine, text)
    run = engine.runner.run

    def run_rambling(scheduled):
        logits, rows = run(scheduled)
        sampled = [s.seq for s in scheduled if s.samples]
        for i, seq in enumerate(sampled):
            out = seq.output_ids
            if not (out == script[:len(out)] and len(out) < len(script)):
                logits[i, words[len(out) % len(words)]] = 120.0  # over EOS and closers
        return logits, rows

    engine.drafter = None  # its logits are scripted one row a sampling row: no drafts
    engine.runner.run = run_rambling


def run_one(engine, schema, max_tokens, engine_name, **request):
    req = GenerationRequest([{"role": "user", "content": "go"}],
                            SamplingParams(max_new_tokens=max_tokens, temperature=0.0),
                            grammar=GrammarSpec.json_schema(schema, engine=engine_name),
                            **request)
    engine.add_request(req)
    chunks = []
    while engine.has_work():
        chunks += [o for o in engine.step() if o.request_id == req.request_id]
    return "".join(c.text for c in chunks), chunks[-1]


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_closing_begins_in_time_after_a_loop_cut(make_tiny_engine, engine_name):
    """The loop guard cuts a run of repeated items; the output cut back then fills a string
    until its budget. A cut used to drop the estimate taken at admission (16 required keys
    to come, longer than twice the window), so the probe at 96 tokens left found a
    completion longer than what was left and the answer ran to its budget cut inside a
    string (Github_ultra/o21219, WashingtonPost/wp_100)."""
    engine = make_tiny_engine()
    rambling_after_script(engine, '{"titles": [' + '{"title": "Titles"}, ' * 12)
    text, final = run_one(engine, MANY_KEYS, 360, engine_name)
    assert final.loop_cuts, "the repeated items were not cut: the test checks nothing"
    assert final.grammar_engine == engine_name
    jsonschema.validate(json.loads(text), MANY_KEYS)
    assert final.finish_reason == "length" and final.closed_early


OPTIONAL_FIRST = {"type": "object", "properties": {
    **{f"optional_property_{i}": {"type": "string"} for i in range(8)},
    **{f"required_property_number_{i}": {"type": "string"} for i in range(10)}},
    "required": [f"required_property_number_{i}" for i in range(10)],
    "additionalProperties": False}


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_a_budget_of_the_checked_shortest_output_closes_valid(make_tiny_engine, engine_name):
    """``max_tokens`` = the grammar check's shortest output, over the closing window, on a
    busy engine (every search cut short): the request is admitted with the output the
    check found (Github_hard/o60179 ran to its budget unclosed: the dive, the only closing
    a busy engine has left, fills optional properties and was longer than the budget)."""
    from worker.guided.grammar_check import GrammarChecker

    engine = make_tiny_engine(closing_probe_ms=30_000.0)
    spec = GrammarSpec.json_schema(OPTIONAL_FIRST, engine=engine_name)
    engine.guided.closer.time_limit_s = 30.0  # the check's searches, on a busy test machine
    shortest = GrammarChecker(engine.guided).check(spec).shortest_output["tokens"]
    assert shortest > engine.config.closing_window
    engine.guided.closer.time_limit_s = 0.0  # a busy engine: every search is cut short
    rambling_after_script(engine, "")
    text, final = run_one(engine, OPTIONAL_FIRST, shortest, engine_name)
    jsonschema.validate(json.loads(text), OPTIONAL_FIRST)
    assert final.finish_reason == "length" and final.closed_early


FEW_REQUIRED = {"type": "object", "properties": {
    **{f"optional_property_{i}": {"type": "string"} for i in range(4)},
    **{f"required_{i}": {"type": "string"} for i in range(3)}},
    "required": [f"required_{i}" for i in range(3)], "additionalProperties": False}


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_a_checked_budget_within_the_window_is_answered_with_the_checked_output(
        make_tiny_engine, engine_name):
    """Within the closing window, the check may report more than the output it found (it
    raises the figure until admission's own dive finds one); a request at the reported
    figure on a busy engine is answered with that output, not sampled freely (o7578, a
    date-time's fraction, was cut unclosed at its checked budget of 46)."""
    from worker.guided.grammar_check import GrammarChecker

    engine = make_tiny_engine(closing_probe_ms=0.0)
    spec = GrammarSpec.json_schema(FEW_REQUIRED, engine=engine_name)
    engine.guided.closer.time_limit_s = 30.0
    GrammarChecker(engine.guided).check(spec)
    compiled = engine.guided.get_grammar(spec).result(timeout=60)
    found = min(len(p) for p in (compiled.facts.start_path,
                                 compiled.facts.witness_path) if p is not None)
    compiled.facts.checked_budget = budget = found + 12  # what such a check reports
    assert budget <= engine.config.closing_window
    engine.guided.closer.time_limit_s = 0.0  # a busy engine: every search is cut short
    rambling_after_script(engine, "")
    text, final = run_one(engine, FEW_REQUIRED, budget, engine_name)
    jsonschema.validate(json.loads(text), FEW_REQUIRED)
    assert final.closed_early and final.completion_tokens == found


LATE_OBJECT = {"type": "object", "properties": {
    **{f"required_property_number_{i}": {"type": "string"} for i in range(8)},
    "titles": {"type": "array", "items": {"type": "string"}},
    "details": {"type": "object", "properties": {
        f"nested_required_property_{i}": {"type": "string"} for i in range(6)},
        "required": [f"nested_required_property_{i}" for i in range(6)],
        "additionalProperties": False}},
    "required": [f"required_property_number_{i}" for i in range(8)],
    "additionalProperties": False}


def late_object_script(engine, budget: int, left_at_open: int) -> str:
    """The required properties, then distinct titles until ``left_at_open`` tokens are left,
    then the optional object opened: its required keys make the completion long again."""
    tok = engine.tokenizer
    words = [t[1:] for t in sorted(tok.get_vocab())
             if t.startswith("\u0120") and t[1:].isalpha() and t[1:].islower() and len(t) >= 8]
    head = "{" + ", ".join(f'"required_property_number_{i}": "{words[-1 - 13 * i]}"'
                           for i in range(8))  # distinct values: nothing for the loop guard
    head += ', "titles": ['
    opening = '], "details": {"nested_required_property_0": "'
    n = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])
    items = []
    while n(head + ", ".join(items) + opening) < budget - left_at_open:
        items.append(f'"{words[len(items) * 7 % len(words)]}"')
    return head + ", ".join(items) + opening


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("left_at_open, opened", [(70, True), (44, False)],
                         ids=["room-left", "too-late"])
def test_an_object_opened_late_in_the_window_still_closes(make_tiny_engine, engine_name,
                                                            left_at_open, opened):
    """The searches near the budget's end find a short completion (close the list), which
    shrank the closing window back to its default; the model then opened an optional object
    of many required keys outside it, and the next search came too late
    (WashingtonPost/wp_100, cut inside a string at 512). The grammar's length from its
    start now stays the window's floor (room-left: the object opens and closes in time),
    and within the window every sampled token is checked, so the ', ' that would open the
    object where its keys no longer fit is replaced by the closing path (too-late)."""
    engine = make_tiny_engine()
    budget = 260
    rambling_after_script(engine, late_object_script(engine, budget, left_at_open))
    text, final = run_one(engine, LATE_OBJECT, budget, engine_name)
    assert final.completion_tokens <= budget
    assert ('"details": {' in text) == opened, text[-200:]
    jsonschema.validate(json.loads(text), LATE_OBJECT)
    if opened:
        assert final.finish_reason == "length" and final.closed_early
    else:  # the list closed where the model wrote ', ' (the object ends the output itself)
        assert engine.stats().closing_steered >= 1
        assert final.finish_reason in ("stop", "length")


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_a_short_known_output_does_not_narrow_the_window(make_engine, engine_name):
    """A short output from the grammar's start is known (the schema's witness, as a grammar
    check or a small budget's search leaves it), far shorter than the way an output
    sampled freely takes (optional keys, lists of objects). The closing window's floor is
    the dive's output from the start, not that short one: with the short one, the default
    model's answer at 256 tokens was cut inside a string on both backends (Github_hard/
    o60179 after a grammar check, and this schema of its shape)."""
    from tests.engine.test_budget_bound_engine import OPTIONAL_FIRST as O60179_SHAPE
    from worker.guided.output_policy import remember_start_path, start_witness

    engine = make_engine()
    spec = GrammarSpec.json_schema(O60179_SHAPE, engine=engine_name)
    compiled = engine.guided.get_grammar(spec).result(timeout=60)
    short = start_witness(spec, engine.guided.new_matcher(compiled), engine.guided.closer)
    assert short is not None and len(short) <= 64
    remember_start_path(compiled, short)
    req = GenerationRequest([{"role": "user", "content": "Answer with JSON."}],
                            SamplingParams(max_new_tokens=256, temperature=0.0), grammar=spec)
    out = engine.generate([req])[req.request_id]
    jsonschema.validate(json.loads(out.text), O60179_SHAPE)
    # the floor is no dive from the start: the schema closer reads what the output needs
    # as it goes (json_closing.py), so closing begins in time without one
    assert compiled.facts.start_dive is None
