"""Where a reasoning model's request starts, read from its rendered prompt
(worker/engine/reasoning.py prompt_thought), and the answer text that shares the end
marker's token. The default model with scripted logits plays the reasoning model (markers
from the config, several tokens each in its vocabulary)."""

import pytest

from core.grammar_spec import GrammarSpec
from core.params import SamplingParams
from worker.engine.reasoning import (CLOSED, OPEN, ReasoningMarkers, opens_thought,
                                     prompt_thought)
from core.request import GenerationRequest

pytestmark = pytest.mark.integration

MARKERS = {"start": "<think>", "end": "</think>"}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}},
          "required": ["name"], "additionalProperties": False}


def script(engine, text: str, ids: list[int] | None = None) -> list[int]:
    """The model writes ``text`` (or the token ids given), then EOS."""
    ids = ids if ids is not None else engine.tokenizer(text, add_special_tokens=False)[
        "input_ids"]
    eos = sorted(engine.eos_ids)[0]
    run = engine.runner.run

    def run_scripted(scheduled):
        logits, rows = run(scheduled)
        logits = logits.clone()
        for i, seq in enumerate(s.seq for s in scheduled if s.samples):
            out = seq.output_ids
            nxt = ids[len(out)] if len(out) < len(ids) and out == ids[:len(out)] else eos
            logits[i] = 0.0
            logits[i, nxt] = 100.0
        return logits, rows

    engine.runner.run = run_scripted
    return ids


def run(engine, prompt, schema=None, **request):
    req = GenerationRequest(prompt, SamplingParams(max_new_tokens=60, temperature=0.0),
                            grammar=GrammarSpec.json_schema(schema) if schema else None,
                            **request)
    engine.add_request(req)
    chunks = []
    while engine.has_work():
        chunks += [o for o in engine.step() if o.request_id == req.request_id]
    assert chunks[-1].finished
    text = "".join(c.text for c in chunks)
    reasoning = "".join(c.reasoning for c in chunks)
    return text, reasoning, chunks[-1]


CHAT = [{"role": "user", "content": "Name a person."}]


def test_prompt_thought_and_opens_thought():
    m = ReasoningMarkers()
    assert prompt_thought("Q?\n<think>\n", m) == OPEN
    assert prompt_thought("Q?\n<think>\nhm</think>\n\n", m) == CLOSED
    assert prompt_thought("old <think>a</think> turn, new <think>", m) == OPEN
    assert prompt_thought("no markers here", m) is None
    assert opens_thought("  <think>", "<think>") and opens_thought("<th", "<think>")
    assert opens_thought("\n\n", "<think>") is None
    assert opens_thought("Ada", "<think>") is False


def test_a_completion_prompt_that_closed_the_thought_starts_in_the_answer(make_engine):
    engine = make_engine(reasoning=MARKERS)
    script(engine, "Ada Lovelace.")
    text, reasoning, final = run(engine, "Q: name a person.\n<think>\nEasy.\n</think>\n\n")
    assert text == "Ada Lovelace." and reasoning == ""
    assert not final.reasoning_tokens


def test_a_guided_request_whose_prompt_closed_the_thought_is_guided_at_once(make_engine):
    engine = make_engine(reasoning=MARKERS)
    script(engine, '{"name": "Ada"}')
    text, reasoning, final = run(engine, "Q\n<think>\n</think>\n", schema=PERSON)
    assert text == '{"name": "Ada"}' and reasoning == ""
    assert final.validation == "valid"


def test_a_direct_answer_to_a_prompt_without_markers_is_the_answer(make_engine):
    """A chat template that opened no thought: the model answers at once."""
    engine = make_engine(reasoning=MARKERS)
    script(engine, "Ada Lovelace.")
    text, reasoning, final = run(engine, CHAT)
    assert text == "Ada Lovelace." and reasoning == ""
    assert not final.reasoning_tokens


def test_a_thought_the_model_opens_itself_is_a_thought(make_engine):
    engine = make_engine(reasoning=MARKERS)
    script(engine, "<think>Someone famous.</think>Ada.")
    text, reasoning, final = run(engine, CHAT)
    assert reasoning == "Someone famous." and text == "Ada."


def test_a_prompt_that_opened_the_thought_starts_in_it(make_engine):
    engine = make_engine(reasoning=MARKERS)
    script(engine, "Someone famous.</think>Ada.")
    text, reasoning, final = run(engine, "Q: name a person.\n<think>\n")
    assert reasoning == "Someone famous." and text == "Ada."
    assert final.reasoning_tokens > 0


def test_text_after_the_marker_in_its_token_is_kept(make_engine):
    """'</think>' ends on a token that goes on ('>"'): that quote is the answer's."""
    engine = make_engine(reasoning=MARKERS)
    tok = engine.tokenizer
    vocab = tok.get_vocab()
    assert '>"' in vocab  # the default model's vocabulary has it
    ids = (tok("Hm.</think", add_special_tokens=False)["input_ids"] + [vocab['>"']]
           + tok('Ada"', add_special_tokens=False)["input_ids"])
    script(engine, "", ids)
    text, reasoning, _ = run(engine, "Q: quote a name.\n<think>\n")
    assert reasoning == "Hm." and text == '"Ada"'
