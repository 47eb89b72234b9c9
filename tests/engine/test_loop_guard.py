"""The loop guard (worker/guided/loop_guard.py, output_policy.py): a guided JSON value that
repeats itself is ended where the repetition began, closed, and the document goes on.

The detector is tested on the real tokenizer's token ids; the engine tests script the
model: the tiny random-weight model (the default model's tokenizer) runs, and its logits
are replaced by a script (the next
token of a looping text while the output follows it, then "end what is open") so the
loop is certain and everything after the forward (mask, policy, matcher, streaming) is
the real path."""

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr

from core.grammar_spec import GrammarSpec
from core.params import LoopGuardParams
from worker.guided.loop_guard import LoopGuard, closer_ids, token_shapes
from worker.engine.sampling import SamplingParams
from core.request import GenerationRequest

pytestmark = pytest.mark.integration

STORE = {"type": "object", "properties": {"store": {"type": "string"}},
         "required": ["store"], "additionalProperties": False}
ITEM = {"type": "object", "properties": {"name": {"type": "string"},
                                         "quantity": {"type": "integer"}},
        "required": ["name", "quantity"], "additionalProperties": False}
ITEMS = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM}},
         "required": ["items"], "additionalProperties": False}
FREE_KEYS = {"type": "object", "additionalProperties": {"type": "integer"}}
FIVE = {"type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer"},
                                               "minItems": 5}},
        "required": ["n"], "additionalProperties": False}
PATTERN = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a{24}$"}},
           "required": ["s"], "additionalProperties": False}


@pytest.fixture(scope="module")
def vocab(default_tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(default_tokenizer, vocab_size=49152)
    return list(info.decoded_vocab), info


def detect(tok, vocab_info, schema, text, params=LoopGuardParams()):
    """Feeds ``text`` token by token; returns the cut text (kept + closers) or None."""
    vocab, info = vocab_info
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    m = xgr.GrammarMatcher(compiled)
    guard = LoopGuard(params, vocab, closer_ids(vocab), token_shapes(vocab))
    out = []
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        assert m.accept_token(t)
        out.append(t)
        guard.push(t)

        def may(keep, closers):  # as OutputPolicy._may_cut
            probe = m.fork()
            probe.rollback(len(out) - keep)
            forced = probe.find_jump_forward_string() if keep == len(out) else ""
            if forced and forced.encode().startswith(b"".join(vocab[c] for c in closers)):
                return False
            return all(probe.accept_token(c) for c in closers)

        cut = guard.find(may)
        if cut is not None:
            return tok.decode(out[:cut.keep] + list(cut.closers))
    return None


@pytest.mark.parametrize("schema, text, unit, closer", [
    (STORE, '{"store": "Pancake, eggs, bacon, eggs, bacon, eggs, bacon, eggs, bacon, eggs',
     "bacon", '"'),
    (STORE, '{"store": "Ko...Ko...Ko...Ko...Ko...Ko...', "Ko", '"'),
    (ITEMS, '{"items": [{"name": "Ava", "quantity": 2}, {"name": "Ava", "quantity": 2}, '
            '{"name": "Ava", "quantity": 2}, {"name": "Ava", "quantity": 2}', "Ava", "}]"),
    (FREE_KEYS, '{"a": 1, "a": 1, "a": 1, "a": 1, "a": 1', '"a"', "}"),
])
def test_a_loop_is_cut_where_it_began(default_tokenizer, vocab, schema, text, unit, closer):
    got = detect(default_tokenizer, vocab, schema, text)
    assert got is not None and got.endswith(closer), got
    kept = got[:-len(closer)]
    assert text.startswith(kept) and len(kept) < len(text), got
    assert 1 <= kept.count(unit) <= 2, got  # one copy of the repeated span kept


@pytest.mark.parametrize("schema, text", [
    (FIVE, '{"n": [5, 5, 5, 5, 5'),  # minItems asks for the repetition
    (PATTERN, '{"s": "aaaaaaaaaaaaaaaaaaaaaaaa'),  # the pattern asks for it
    ({"type": "object", "properties": {"n": {"type": "integer"}}},
     '{"n": 1000000000000000'),  # numbers are never cut
    (STORE, '{"store": "one two three four five six seven eight nine ten'),  # no loop
])
def test_a_repetition_the_schema_asks_for_is_not_cut(default_tokenizer, vocab, schema, text):
    assert detect(default_tokenizer, vocab, schema, text) is None


def test_minitems_repetition_is_cut_only_after_the_minimum(default_tokenizer, vocab):
    got = detect(default_tokenizer, vocab, FIVE, '{"n": [5, 5, 5, 5, 5, 5, 5, 5, 5')
    assert got == '{"n": [5, 5, 5, 5, 5]', got


TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["tags"], "additionalProperties": False}
PRICED = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "quantity": {"type": "integer"}},
    "required": ["name", "quantity"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}
NUMS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "integer"}}},
        "required": ["tags"], "additionalProperties": False}


def _items(n, first=0):
    return ", ".join(f'{{"name": "{chr(65 + i)}", "quantity": {i + 1}}}'
                     for i in range(first, n))


@pytest.mark.parametrize("schema, text, kept", [
    # counters that change: the same shape, the copies seen kept, the array closed
    (TAGS, '{"tags": ["' + '", "'.join("bcdefghijklmnop"), '{"tags": ["' + '", "'.join(
        "bcdefghi") + '"]'),
    (TAGS, '{"tags": ["api", ' + ", ".join(f'"v{i}.0"' for i in range(2, 17)),
     '{"tags": ["api", ' + ", ".join(f'"v{i}.0"' for i in range(2, 9)) + "]"),
    (PRICED, '{"items": [' + _items(10), '{"items": [' + _items(8) + "]"),
    (STORE, '{"store": "' + ", ".join(str(i) for i in range(49, 70)),  # counting in a string
     '{"store": "' + ", ".join(str(i) for i in range(49, 56)) + ', "'),
])
def test_a_progression_is_ended_after_its_copies(default_tokenizer, vocab, schema, text, kept):
    assert detect(default_tokenizer, vocab, schema, text) == kept


@pytest.mark.parametrize("schema, text", [
    (NUMS, '{"tags": [90, 85, 77, 92, 61, 88, 73, 95, 81, 66, 70, 99, 12, 34, 56, 78, 90'),
    (TAGS, '{"tags": [' + ", ".join(f'"2024-01-{d:02}"' for d in range(1, 20))),  # dates
    (TAGS, '{"tags": ["apple", "banana", "cherry", "date", "elderberry", "fig", "grape", '
           '"honeydew", "kiwi", "lemon", "mango"'),
    (TAGS, '{"tags": [' + ", ".join(f'"Chapter {i}"' for i in range(1, 8))),  # 7 < 8 copies
])
def test_data_is_not_a_progression(default_tokenizer, vocab, schema, text):
    assert detect(default_tokenizer, vocab, schema, text) is None


def test_progressions_can_be_turned_off(default_tokenizer, vocab):
    text = '{"items": [' + _items(12)
    assert detect(default_tokenizer, vocab, PRICED, text,
                  LoopGuardParams(progression_repeats=0)) is None


def test_params_are_checked():
    assert LoopGuardParams.from_value(False).enabled is False
    assert LoopGuardParams.from_value({"min_repeats": 4}).min_repeats == 4
    with pytest.raises(ValueError, match="unknown loop_guard field"):
        LoopGuardParams.from_value({"repeats": 4})
    with pytest.raises(ValueError, match="min_repeats"):
        LoopGuardParams(min_repeats=1)
    with pytest.raises(ValueError, match="progression_repeats"):
        LoopGuardParams(progression_repeats=1)


# through the engine, with a scripted model ---------------------------------------------------

def scripted(engine, text):
    """Makes the engine's model follow ``text`` while the output is a prefix of its tokens;
    off the script, it prefers EOS, then closers (so a cut value ends and the rest closes)."""
    tok = engine.tokenizer
    script = tok(text, add_special_tokens=False)["input_ids"]
    eos = sorted(engine.eos_ids)[0]
    closers = [tok.convert_tokens_to_ids(t) for t in ("}", "]", '"')]
    run = engine.runner.run

    def run_scripted(scheduled):
        logits, rows = run(scheduled)
        logits = logits.clone()
        sampled = [s.seq for s in scheduled if s.samples]
        for i, seq in enumerate(sampled):
            out = seq.output_ids
            logits[i] = 0.0
            if out == script[:len(out)] and len(out) < len(script):
                logits[i, script[len(out)]] = 100.0
            else:
                logits[i, eos] = 100.0
                for rank, t in enumerate(closers):
                    logits[i, t] = 50.0 - rank
        return logits, rows

    engine.drafter = None  # its logits are scripted one row a sampling row: no drafts
    engine.runner.run = run_scripted


def generate(engine, schema, max_tokens=200, **request):
    req = GenerationRequest([{"role": "user", "content": "go"}],
                            SamplingParams(max_new_tokens=max_tokens, temperature=0.0),
                            grammar=GrammarSpec.json_schema(schema), **request)
    engine.add_request(req)
    chunks = []
    while engine.has_work():
        chunks += [o for o in engine.step() if o.request_id == req.request_id]
    final = chunks[-1]
    assert final.finished
    return chunks, final


LOOPS = [
    (STORE, '{"store": "Pancake, ' + "bacon, eggs, " * 40),
    (ITEMS, '{"items": [' + '{"name": "Ava", "quantity": 2}, ' * 20),
    (FREE_KEYS, "{" + '"a": 1, ' * 40),
]


@pytest.mark.parametrize("schema, text", LOOPS, ids=["string", "array-items", "free-keys"])
def test_engine_cuts_a_loop_and_the_answer_completes(make_tiny_engine, schema, text):
    engine = make_tiny_engine()
    scripted(engine, text)
    chunks, final = generate(engine, schema)
    streamed = "".join(c.text for c in chunks)
    answer = json.loads(streamed)  # streamed text is the whole answer: nothing taken back
    jsonschema.validate(answer, schema)
    assert final.finish_reason == "stop" and final.loop_cuts == 1
    assert final.validation == "valid"
    assert final.completion_tokens < 80  # ended near where the loop began, not at 200
    assert sum(len(c.token_ids) for c in chunks) == final.completion_tokens
    stats = engine.stats()
    assert stats.loop_cuts == 1 and stats.loop_cut_outputs == 1
    assert stats.live_processors == 0


def test_a_loop_found_after_its_text_was_streamed_ends_where_it_is(make_tiny_engine):
    engine = make_tiny_engine()
    scripted(engine, LOOPS[0][1])
    chunks, final = generate(engine, STORE,
                             loop_guard=LoopGuardParams(hold_tokens=0))
    text = "".join(c.text for c in chunks)
    jsonschema.validate(json.loads(text), STORE)
    assert final.finish_reason == "stop" and final.loop_cuts == 1


def test_the_guard_can_be_turned_off_per_request(make_tiny_engine):
    engine = make_tiny_engine()
    scripted(engine, LOOPS[0][1])
    chunks, final = generate(engine, STORE, max_tokens=60,
                             loop_guard=LoopGuardParams(enabled=False))
    assert final.finish_reason == "length" and final.loop_cuts == 0
    assert final.closed_early and final.validation == "valid"


def test_the_stream_holds_back_only_the_newest_tokens(make_tiny_engine):
    engine = make_tiny_engine()
    # no loop (w1 w2 w3 ... or 12 34 56 ... would be a progression): distinct words
    words = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
             "november oscar papa quebec romeo sierra tango uniform victor whiskey xray "
             "yankee zulu apple banana cherry grape lemon mango melon orange peach pear plum")
    scripted(engine, '{"store": "' + words)
    req = GenerationRequest([{"role": "user", "content": "go"}],
                            SamplingParams(max_new_tokens=40, temperature=0.0),
                            grammar=GrammarSpec.json_schema(STORE))
    seq = engine.add_request(req)
    streamed = 0
    hold = LoopGuardParams().hold_tokens
    while engine.has_work():
        for out in engine.step():
            streamed += len(out.token_ids)
            if not out.finished:
                assert streamed == max(0, seq.num_output - hold)
    assert streamed == seq.num_output


def test_a_legitimate_repetition_through_the_engine_is_kept(make_tiny_engine):
    engine = make_tiny_engine()
    text = '{"n": [5, 5, 5, 5, 5]}'
    scripted(engine, text)
    chunks, final = generate(engine, FIVE)
    assert "".join(c.text for c in chunks) == text
    assert final.loop_cuts == 0 and final.finish_reason == "stop"


# the client libraries on a cut answer ---------------------------------------------------------

def test_client_libraries_parse_a_cut_answer(make_tiny_engine):
    """openai parse(), instructor (JSON_SCHEMA) and langchain (json_schema) each send their
    own request; our planner plans it, the engine (scripted into a loop) answers, our
    response builder writes the body, and each library returns its object."""
    import httpx
    import instructor
    import openai
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    from deploy import openai_api as api
    from deploy.responses import response_body
    from deploy.settings import Limits

    class Store(BaseModel):
        store: str

    engine = make_tiny_engine()
    scripted(engine, LOOPS[0][1])
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        plan = api.plan_chat(api.parse_request(api.ChatCompletionRequest, sent), Limits())
        assert plan.grammar is not None  # the library asked for its schema
        final = engine.generate(plan.requests)[plan.requests[0].request_id]
        body = response_body(plan, [final], sent["model"])
        bodies.append(body)
        return httpx.Response(200, json=body)

    http = httpx.Client(transport=httpx.MockTransport(handler))
    client = openai.OpenAI(base_url="http://rayguide/v1", api_key="none", max_retries=0,
                           http_client=http)
    ask = [{"role": "user", "content": "What do I buy?"}]
    got = [client.chat.completions.parse(model="m", messages=ask,
                                         response_format=Store).choices[0].message.parsed,
           instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA).chat.completions
           .create(model="m", messages=ask, response_model=Store, max_retries=0),
           ChatOpenAI(model="m", base_url="http://rayguide/v1", api_key="none", max_retries=0,
                      http_client=http).with_structured_output(Store, method="json_schema")
           .invoke("What do I buy?")]
    assert len(bodies) == 3
    for body, obj in zip(bodies, got):
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["guided"]["loop_cut"]
        assert isinstance(obj, Store) and obj.store.startswith("Pancake, bacon, eggs")
        assert obj.store.count("bacon") <= 2  # ended where the loop began


LONG_CLOSE = {"type": "object", "properties": {
    "titles": {"type": "array", "items": {
        "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"],
        "additionalProperties": False}},
    **{f"required_property_number_{i}": {"type": "string"} for i in range(6)}},
    "required": ["titles"] + [f"required_property_number_{i}" for i in range(6)],
    "additionalProperties": False}


def test_a_completion_longer_than_the_closing_window_still_closes(make_tiny_engine):
    # six required keys still to come: their shortest completion is longer than the
    # closing window (48), so closing must begin before it (the estimate from the
    # grammar's start, taken at admission, where the probe at twice the window took it
    # before); it gave up and returned unterminated JSON before
    engine = make_tiny_engine()
    scripted(engine, '{"titles": [' + '{"title": "Titles"}, ' * 60)
    chunks, final = generate(engine, LONG_CLOSE, max_tokens=200,
                             loop_guard=LoopGuardParams(enabled=False))
    text = "".join(c.text for c in chunks)
    jsonschema.validate(json.loads(text), LONG_CLOSE)
    assert final.finish_reason == "length" and final.closed_early
    assert engine.stats().closing_probes == 0  # (known from admission)


DESCRIPTIONS = {"type": "object", "properties": {"descriptions": {"type": "array", "items": {
    "type": "object", "properties": {
        "description": {"type": "string"},
        "description_type": {"enum": ["Abstract", "Methods", "Other"]}},
    "required": ["description", "description_type"], "additionalProperties": False}}},
    "required": ["descriptions"], "additionalProperties": False}


def test_a_long_item_loop_is_cut_although_its_boundaries_come_once_a_period(make_tiny_engine):
    # a 32-token item, longer than the 16 held-back tokens: the array may close only
    # after an item's last token, once per period, so a place to cut must be caught at
    # the token it appears (looking again a whole period later kept finding it behind
    # what was streamed, in phase, on a JSONSchemaBench answer that looped to its budget)
    engine = make_tiny_engine()
    item = ('{"description": "The title(s) of the uploaded resource, or a name by which the '
            'resource is known.", "description_type": "Methods"}, ')
    scripted(engine, '{"descriptions": [' + item * 12)
    chunks, final = generate(engine, DESCRIPTIONS, max_tokens=400)
    answer = json.loads("".join(c.text for c in chunks))
    jsonschema.validate(answer, DESCRIPTIONS)
    assert final.finish_reason == "stop" and final.loop_cuts == 1
    assert len(answer["descriptions"]) <= 2
