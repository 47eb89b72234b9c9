"""A request's forward steps are bounded whatever its ``loop_guard`` (issue 58 item 4): a
loop cut rolls tokens back and gives their budget back, so a model that loops again after
every cut would draw far past ``max_tokens``; the engine counts the tokens drawn for a
request, cut or not, against ``DRAWS_PER_TOKEN * max_tokens`` (engine.py ``_remaining``),
and the output is closed as its budget's end would close it.

The tiny random-weight model, its logits replaced by a script: inside a string it writes
one phrase again and again; outside, it opens one more array item."""

import json

import pytest

from core.grammar_spec import GrammarSpec
from core.params import LoopGuardParams, SamplingParams
from core.request import GenerationRequest
from worker.engine.engine import DRAWS_PER_TOKEN

pytestmark = pytest.mark.integration

NOTES = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"],
    "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False}
# the guard at the settings that make a cut give back the most: found after the most exact
# copies (16: progressions, which keep theirs, off), one copy kept, every cut allowed
GREEDY_GUARD = LoopGuardParams(min_repeats=16, long_span=256, hold_tokens=256, max_cuts=64,
                               progression_repeats=0, near_repeats=0, sentence_repeats=0)


WORDS = ("apple river stone cloud maple ember frost grain harbor island jungle kettle "
         "lantern meadow nectar orchid pepper quartz saddle timber velvet willow").split()


def looping(engine):
    """Inside a string the model repeats a phrase of two words, ``apple river, apple
    river, ...`` (a loop); outside, it opens one more item, whose phrase is another (so the
    items themselves never repeat): after each cut it loops again in a new item."""
    tok = engine.tokenizer
    phrases = [tok(f"{a} {b}, ", add_special_tokens=False)["input_ids"]
               for a, b in zip(WORDS, WORDS[7:] + WORDS[:7])]
    prefer = [tok.convert_tokens_to_ids(t) for t in ("{", ",", "}", '"', "]")]
    run = engine.runner.run

    def run_looping(scheduled):
        logits, rows = run(scheduled)
        logits = logits.clone()
        for i, seq in enumerate(s.seq for s in scheduled if s.samples):
            text = tok.decode(seq.output_ids)
            logits[i] = 0.0
            for rank, t in enumerate(prefer):
                logits[i, t] = 60.0 - rank
            if text.count('"') % 2 == 1:  # in a string
                cycle = phrases[text.count("{") % len(phrases)]
                logits[i, cycle[len(seq.output_ids) % len(cycle)]] = 100.0
        return logits, rows

    engine.drafter = None  # its logits are scripted one row a sampling row: no drafts
    engine.runner.run = run_looping


def test_a_request_that_loops_after_every_cut_draws_a_bounded_number_of_tokens(
        make_tiny_engine):
    engine = make_tiny_engine(max_num_seqs=2)
    looping(engine)
    max_tokens = 256
    req = GenerationRequest([{"role": "user", "content": "go"}],
                            SamplingParams(max_new_tokens=max_tokens, temperature=0.0),
                            grammar=GrammarSpec.json_schema(NOTES), loop_guard=GREEDY_GUARD)
    engine.add_request(req)
    final = None
    for _ in range(20 * max_tokens):  # a hang guard: the bound is far below
        if not engine.has_work():
            break
        for out in engine.step():
            final = out if out.finished else final
    assert final is not None and final.finished
    st = engine.stats()
    assert final.loop_cuts >= 2, final  # it looped again after a cut
    assert st.sampled_tokens > max_tokens  # the cuts gave tokens back: the bound ended it
    # every step drew one token for it but its prompt's (one chunk here)
    assert st.sampled_tokens <= DRAWS_PER_TOKEN * max_tokens, st.sampled_tokens
    assert engine.num_steps <= DRAWS_PER_TOKEN * max_tokens + 1, engine.num_steps
    # and the output is a whole document, closed at the bound as at a budget's end
    assert final.finish_reason == "length" and final.closed_early, final
    assert final.validation == "valid"
    assert st.free_blocks == st.total_blocks and st.live_processors == 0
    assert not engine._draws  # nothing kept per request after it ended


def test_an_ordinary_request_is_not_touched_by_the_bound(make_tiny_engine):
    # a guard that never cuts: the draws are the output's tokens, and the budget is
    # max_tokens exactly
    engine = make_tiny_engine(max_num_seqs=2)
    looping(engine)
    req = GenerationRequest([{"role": "user", "content": "go"}],
                            SamplingParams(max_new_tokens=40, temperature=0.0),
                            grammar=GrammarSpec.json_schema(NOTES), loop_guard=False)
    merged = engine.generate([req])[req.request_id]
    assert merged.finish_reason == "length" and merged.completion_tokens <= 40
    assert merged.completion_tokens >= 36, merged.completion_tokens  # closed near the end
    json.loads(merged.text)
