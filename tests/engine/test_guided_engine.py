"""Guided decoding through the engine with the real default model."""

import json
import re

import jsonschema
import pytest

from core.grammar_spec import GrammarSpec
from worker.engine.sampling import SamplingParams
from core.request import GenerationRequest

pytestmark = pytest.mark.integration

STR = {"type": "string", "maxLength": 24}
SCHEMAS = [
    {"type": "object", "properties": {"name": STR, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": STR, "country": STR, "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "country"]},
    {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}},
     "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": STR, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "first": STR, "last": STR}, "required": ["first", "last"]}}, "required": ["person"]},
    {"type": "object", "properties": {"title": STR, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                      "rating": {"type": "number"}}, "required": ["title", "year"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "label": STR},
        "required": ["id", "label"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": STR}, "required": ["ok"]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                      "required": ["x", "y"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
     "required": ["start", "end"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "code": {"type": "integer"}},
     "required": ["status", "code"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]}},
     "required": ["value"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer"}}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"name": STR, "nick": {"type": ["string", "null"], "maxLength": 12}},
     "required": ["name", "nick"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^2024-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0}, "currency": {
        "enum": ["USD", "EUR"]}}, "required": ["price", "currency"]},
]


def chat(text):
    return [{"role": "user", "content": text}]


def greedy(n=96, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def run(engine, reqs):
    out = engine.generate(reqs)
    return [out[r.request_id] for r in reqs]


def test_json_schemas_validate(make_engine):
    engine = make_engine()
    reqs = [GenerationRequest(chat(f"Reply in JSON matching this schema: {json.dumps(s)}"),
                              greedy(), grammar=GrammarSpec.json_schema(s)) for s in SCHEMAS]
    outs = run(engine, reqs)
    for schema, out in zip(SCHEMAS, outs):  # valid whatever ended it (a budget cut closes)
        assert out.finish_reason in ("stop", "length"), out.error
        jsonschema.validate(json.loads(out.text), schema)
        assert out.validation == "valid", (out.finish_reason, out.text)
    assert sum(o.finish_reason == "stop" for o in outs) >= len(SCHEMAS) * 0.75
    assert engine.stats().live_processors == 0


def test_regex_choice_ebnf_and_structural_tag(make_engine):
    engine = make_engine()
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"]}
    # at least one call: the check below has a call to check in every run
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<call>"], "at_least_one": True,
        "stop_after_first": True, "tags": [{"type": "tag", "begin": "<call>", "end": "</call>",
                                            "content": {"type": "json_schema",
                                                        "json_schema": city}}]}}
    cases = [
        (chat("What is the phone number?"), GrammarSpec.regex(r"\(\d{3}\) \d{3}-\d{4}"),
         lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t)),
        (chat("Is the sky blue? Answer yes or no."), GrammarSpec.choice(["yes", "no"]),
         lambda t: t in ("yes", "no")),
        (chat("List some fruit."), GrammarSpec.ebnf(
            'root ::= "- " item ("\\n- " item)*\nitem ::= "apple" | "pear" | "plum"'),
         lambda t: re.fullmatch(r"- (apple|pear|plum)(\n- (apple|pear|plum))*", t)),
        (chat("Call the weather tool for Paris: <call>{...}</call>"), GrammarSpec.structural_tag(tag),
         tag_calls_valid),
        (chat("Give a JSON object about a cat."), GrammarSpec.json_object(),
         lambda t: isinstance(json.loads(t), dict)),
    ]
    reqs = [GenerationRequest(p, greedy(48), grammar=g) for p, g, _ in cases]
    for (_, spec, check), out in zip(cases, run(engine, reqs)):
        assert out.finish_reason in ("stop", "length"), out.error
        assert check(out.text), (spec.kind, out.finish_reason, out.text)


def tag_calls_valid(text: str) -> bool:
    """At least one call, and every call opened is whole: a JSON object with a city."""
    calls = re.findall(r"<call>(.*?)</call>", text, re.S)
    return (len(calls) >= 1 and text.count("<call>") == len(calls)
            and all(isinstance(json.loads(c)["city"], str) for c in calls))


def test_bad_grammar_fails_alone(make_engine):
    engine = make_engine()
    good = GenerationRequest(chat("Say hi."), greedy(8))
    guided = GenerationRequest(chat("yes or no?"), greedy(8), grammar=GrammarSpec.choice(["yes", "no"]))
    bad = GenerationRequest(chat("x"), greedy(8), grammar=GrammarSpec.regex("(unclosed"))
    outs = run(engine, [good, bad, guided])
    assert outs[0].finish_reason in ("stop", "length") and outs[0].text
    assert outs[1].finish_reason == "error" and "invalid regex grammar" in outs[1].error
    assert outs[2].text in ("yes", "no")
    again = GenerationRequest(chat("x"), greedy(8), grammar=GrammarSpec.regex("(unclosed"))
    compiles = engine.stats().grammar_cache["compiles"]
    [out] = run(engine, [again])
    assert out.finish_reason == "error" and engine.stats().grammar_cache["compiles"] == compiles


def test_unguided_output_unchanged_by_guided_neighbours(make_engine):
    engine = make_engine()
    prompts = [chat("Tell me about the ocean."), chat("Write a limerick about a cat.")]
    alone = run(engine, [GenerationRequest(p, greedy(40)) for p in prompts])
    mixed_reqs = [GenerationRequest(p, greedy(40)) for p in prompts] + [
        GenerationRequest(chat("JSON please"), greedy(40), grammar=GrammarSpec.json_schema(s))
        for s in SCHEMAS[:4]]
    mixed = run(engine, mixed_reqs)
    for a, m in zip(alone, mixed):
        assert a.token_ids == m.token_ids


def test_budget_cut_output_is_closed_and_valid(make_engine):
    engine = make_engine()
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    [out] = run(engine, [GenerationRequest(chat("Write a long story as JSON."), greedy(12),
                                           grammar=GrammarSpec.json_schema(schema))])
    assert out.finish_reason == "length" and out.closed_early and out.completion_tokens <= 12
    jsonschema.validate(json.loads(out.text), schema)
    assert out.validation == "valid" and out.approximated == []


def test_terminated_matcher_stops_even_with_ignore_eos(make_engine):
    engine = make_engine()
    [out] = run(engine, [GenerationRequest(chat("yes or no?"), greedy(16, ignore_eos=True),
                                           grammar=GrammarSpec.choice(["yes", "no"]))])
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_session_turns_get_fresh_matchers(make_engine):
    engine = make_engine()
    t1 = chat("Answer yes or no: is water wet?")
    [a] = run(engine, [GenerationRequest(t1, greedy(8), session_id="s",
                                         grammar=GrammarSpec.choice(["yes", "no"]))])
    assert a.text in ("yes", "no")
    t2 = t1 + [{"role": "assistant", "content": a.text}, {"role": "user", "content": "Now a number."}]
    [b] = run(engine, [GenerationRequest(t2, greedy(8), session_id="s",
                                         grammar=GrammarSpec.regex("[0-9]{1,3}"))])
    assert re.fullmatch("[0-9]{1,3}", b.text) and b.cached_tokens > 0
    # two samples of one session, each with its own matcher (seq_id)
    reqs = [GenerationRequest(t1, SamplingParams(max_new_tokens=8, temperature=1.0, seed=i),
                              session_id="s2", seq_id=i, grammar=GrammarSpec.choice(["yes", "no"]))
            for i in range(2)]
    assert all(o.text in ("yes", "no") for o in run(engine, reqs))
    for sid in ("s", "s2"):
        engine.end_session(sid)
    st = engine.stats()
    assert st.live_processors == 0 and st.free_blocks == st.total_blocks


def test_end_session_mid_generation_releases_everything(make_engine):
    engine = make_engine()
    spec = GrammarSpec.json_schema(SCHEMAS[0])
    seq = engine.add_request(GenerationRequest(chat("JSON"), greedy(64), session_id="live", grammar=spec))
    while not engine.seqs[seq.request_id].output_ids:
        engine.step()
    assert engine.stats().live_processors == 1
    [final] = engine.end_session("live")
    assert final.finish_reason == "abort"
    st = engine.stats()
    assert st.live_processors == 0 and st.free_blocks == st.total_blocks and not engine.has_work()


def test_leak_1000_short_guided_sessions(make_tiny_engine):
    # what is counted is the engine's bookkeeping, not the model's words: the tiny model
    engine = make_tiny_engine(max_num_seqs=64)
    specs = [GrammarSpec.choice(["yes", "no"]), GrammarSpec.regex("[0-9]{2}"),
             GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "boolean"}},
                                      "required": ["a"]}, whitespace="compact")]
    for wave in range(5):
        reqs = [GenerationRequest(f"Q{i}:", greedy(12), session_id=f"w{wave}-{i}",
                                  grammar=specs[i % 3]) for i in range(200)]
        outs = run(engine, reqs)
        assert all(o.finish_reason in ("stop", "length") for o in outs)
        for r in reqs:
            engine.end_session(r.session_id)
    st = engine.stats()
    assert st.live_processors == 0 and st.live_sessions == 0
    assert st.free_blocks == st.total_blocks and st.running == st.waiting == 0
    assert st.grammar_cache["compiles"] <= 3
