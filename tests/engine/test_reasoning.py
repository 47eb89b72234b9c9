"""Reasoning models through the engine (worker/guided/reasoning.py): a free thought, then
the answer in the grammar. The tiny model (the default model's tokenizer) with scripted
logits plays a reasoning model
(markers from the config: several tokens each, or one special token each), so the
boundary logic is tested without a real reasoning model."""

import json
import random

import jsonschema
import pytest

from core.errors import ErrorKind
from core.grammar_spec import GrammarSpec
from core.params import SamplingParams
from worker.guided.reasoning import ReasoningMarkers, Thinking, thought_end
from core.request import GenerationRequest

pytestmark = pytest.mark.integration

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ANSWER = '{"name": "Ada", "age": 36}'
THOUGHT = "The user wants a person. {not json [ at all. Ada is 36."
MULTI = {"start": "<think>", "end": "</think>"}  # several tokens each in this vocabulary
SINGLE = {"start": "<filename>", "end": "<file_sep>"}  # one special token each


def scripted(engine, thought: str, answer: str, end: str, seen: list | None = None):
    """The model writes ``thought``, the end marker and ``answer``; once the thought is
    off its script (a forced marker), it writes ``answer`` from wherever the answer begins.
    Off every script it prefers EOS. ``seen`` collects what the matchers accept."""
    tok = engine.tokenizer
    thought_ids = tok(thought + end, add_special_tokens=False)["input_ids"]
    answer_ids = tok(answer, add_special_tokens=False)["input_ids"]
    eos = sorted(engine.eos_ids)[0]
    run = engine.runner.run

    def raw(ids):
        return tok.decode(ids, skip_special_tokens=False)

    def run_scripted(scheduled):
        logits, rows = run(scheduled)
        logits = logits.clone()
        for i, seq in enumerate(s.seq for s in scheduled if s.samples):
            out = seq.output_ids
            logits[i] = 0.0
            at = thought_end(raw, out, end) if out else None
            if at is None:
                nxt = thought_ids[len(out)] if len(out) < len(thought_ids) and \
                    out == thought_ids[:len(out)] else thought_ids[0]
            else:
                done = out[at:]
                nxt = answer_ids[len(done)] if len(done) < len(answer_ids) and \
                    done == answer_ids[:len(done)] else eos
            logits[i, nxt] = 100.0
        return logits, rows

    engine.drafter = None  # its logits are scripted one row a sampling row: no drafts
    engine.runner.run = run_scripted
    if seen is not None:
        add = engine.guided.add_matcher

        def recording(compiled):
            matcher = add(compiled)
            accept = matcher.accept_token

            def accept_token(t):
                seen.append(t)
                return accept(t)

            matcher.accept_token = accept_token
            return matcher

        engine.guided.add_matcher = recording
    return answer_ids


def run(engine, schema=PERSON, max_tokens=120, prompt=None, **request):
    """One request to the end. The prompt opens a thought (as a reasoning template's
    generation prompt does: a request starts in a thought only then) unless given."""
    if prompt is None:
        prompt = ([{"role": "user", "content": "a person"}] if engine.guide.reasoning is None
                  else f"Describe a person.\n{engine.guide.reasoning.start}\n")
    req = GenerationRequest(prompt,
                            SamplingParams(max_new_tokens=max_tokens, temperature=0.0),
                            grammar=GrammarSpec.json_schema(schema) if schema else None,
                            **request)
    engine.add_request(req)
    chunks = []
    while engine.has_work():
        chunks += [o for o in engine.step() if o.request_id == req.request_id]
    final = chunks[-1]
    assert final.finished
    return chunks, final


@pytest.mark.parametrize("markers", [MULTI, SINGLE], ids=["multi-token", "single-token"])
def test_the_grammar_starts_right_after_the_marker(make_tiny_engine, markers):
    engine = make_tiny_engine(reasoning=markers)
    seen = []
    answer_ids = scripted(engine, THOUGHT, ANSWER, markers["end"], seen)
    chunks, final = run(engine)
    assert "".join(c.reasoning for c in chunks) == THOUGHT  # no marker, streamed whole
    assert "".join(c.text for c in chunks) == ANSWER
    assert final.finish_reason == "stop" and final.validation == "valid"
    # the matcher saw the answer's tokens and nothing of the thought (the thought is not
    # JSON: masked, it could not have been written)
    assert seen[:len(answer_ids)] == answer_ids
    assert len(seen) <= len(answer_ids) + 1  # + the EOS that ends it
    end_ids = engine.tokenizer(markers["end"], add_special_tokens=False)["input_ids"]
    assert len(end_ids) == (1 if markers is SINGLE else 3)
    assert final.reasoning_tokens == len(engine.tokenizer(
        THOUGHT + markers["end"], add_special_tokens=False)["input_ids"])
    assert sum(len(c.token_ids) for c in chunks) == final.completion_tokens
    assert engine.stats().live_processors == 0 and engine.stats().running == 0


def test_no_chunk_shows_a_piece_of_the_marker(make_tiny_engine):
    """The multi-token marker arrives over several steps (one chunk each): the reasoning
    deltas hold its first pieces back, so no chunk carries '</' or 'think'."""
    engine = make_tiny_engine(reasoning=MULTI)
    scripted(engine, "ok <b> done", ANSWER, MULTI["end"])
    chunks, final = run(engine)
    assert [c.reasoning for c in chunks if c.reasoning]
    assert all("</" not in c.reasoning and "think" not in c.reasoning for c in chunks)
    assert "".join(c.reasoning for c in chunks) == "ok <b> done"


@pytest.mark.parametrize("budget", [0, 1, 7, 24])
def test_the_budget_forces_the_marker(make_tiny_engine, budget):
    engine = make_tiny_engine(reasoning=MULTI)
    long_thought = "Let me think step by step about every detail. " * 10
    scripted(engine, long_thought, ANSWER, MULTI["end"])
    chunks, final = run(engine, thinking_token_budget=budget)
    end_ids = engine.tokenizer(MULTI["end"], add_special_tokens=False)["input_ids"]
    assert final.reasoning_tokens == budget + len(end_ids)
    assert "".join(c.text for c in chunks) == ANSWER
    assert final.validation == "valid"
    assert engine.stats().thoughts_forced == 1


def test_the_server_default_budget_applies(make_tiny_engine):
    engine = make_tiny_engine(reasoning=MULTI, thinking_token_budget=5)
    scripted(engine, "Let me think step by step about every detail. " * 5, ANSWER,
             MULTI["end"])
    _, final = run(engine)
    assert final.reasoning_tokens == 5 + 3


def test_a_stop_token_in_the_thought_becomes_the_marker(make_tiny_engine):
    """A guided request owes its answer: EOS while thinking ends the thought, not the
    request."""
    engine = make_tiny_engine(reasoning=MULTI)
    eos = engine.tokenizer.decode([sorted(engine.eos_ids)[0]])
    scripted(engine, "short" + eos, ANSWER, MULTI["end"])
    chunks, final = run(engine)
    assert "".join(c.text for c in chunks) == ANSWER and final.validation == "valid"
    assert "".join(c.reasoning for c in chunks) == "short"


def test_the_answer_validates_when_the_thought_eats_the_budget(make_tiny_engine):
    """No thinking budget: the thought runs until only the answer's room is left, and the
    answer still closes inside max_tokens."""
    engine = make_tiny_engine(reasoning=MULTI)
    scripted(engine, "I keep thinking. " * 100, ANSWER + " " * 50, MULTI["end"])
    chunks, final = run(engine, max_tokens=60)
    assert final.completion_tokens <= 60
    answer = json.loads("".join(c.text for c in chunks))
    jsonschema.validate(answer, PERSON)
    assert final.validation == "valid"


def test_a_budget_without_room_for_the_answer_is_refused(make_tiny_engine):
    engine = make_tiny_engine(reasoning=MULTI)
    scripted(engine, THOUGHT, ANSWER, MULTI["end"])
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string"}
                                            for i in range(12)},
           "required": [f"field_{i}" for i in range(12)]}
    _, final = run(engine, schema=big, max_tokens=30)
    assert final.finish_reason == "error"
    assert final.error_kind is ErrorKind.BUDGET_TOO_SMALL
    assert engine.stats().live_processors == 0


def test_unguided_requests_think_too(make_tiny_engine):
    """(Its prompt opens no thought: the model opens one itself, so it is one.)"""
    engine = make_tiny_engine(reasoning=MULTI)
    scripted(engine, MULTI["start"] + THOUGHT, "Ada, 36.", MULTI["end"])
    chunks, final = run(engine, schema=None, prompt=[{"role": "user", "content": "a person"}])
    assert "".join(c.reasoning for c in chunks) == THOUGHT
    assert "".join(c.text for c in chunks) == "Ada, 36."
    assert final.finish_reason == "stop"


def test_an_engine_without_markers_has_no_thought(make_engine):
    engine = make_engine()
    chunks, final = run(engine, thinking_token_budget=3, max_tokens=40)
    assert final.reasoning_tokens is None and not any(c.reasoning for c in chunks)
    assert engine.stats().thinking_tokens == 0


@pytest.mark.parametrize("cut", [5, 20, 30])  # mid-thought, at the marker, mid-answer
def test_failover_resumes_in_the_right_phase(make_tiny_engine, cut):
    """A continuation (what the runtime client sends when a worker dies mid-stream) of
    the output streamed so far ends as the uninterrupted request did: the thought is
    not fed to the matcher, the answer goes on where it stopped."""
    engine = make_tiny_engine(reasoning=MULTI)
    scripted(engine, THOUGHT, ANSWER, MULTI["end"])
    whole, final = run(engine)
    tokens = [t for c in whole for t in c.token_ids]
    assert len(tokens) > cut
    got, text, reasoning = [], "", ""
    for c in whole:  # what the client had received when the worker died
        if len(got) + len(c.token_ids) > cut:
            break
        got += c.token_ids
        text += c.text
        reasoning += c.reasoning
    chunks, again = run(engine, resume_token_ids=got, resume_text=text)
    assert text + "".join(c.text for c in chunks) == ANSWER
    assert reasoning + "".join(c.reasoning for c in chunks) == THOUGHT
    assert again.validation == "valid"
    assert again.reasoning_tokens == final.reasoning_tokens


def test_fuzz_thoughts_and_markers(make_tiny_engine):
    """Random thought lengths, markers and budgets: every answer validates, and no
    thinking token reaches a matcher."""
    rng = random.Random(7)
    words = ["so", "maybe", "{", "]", '"', "ok,", "7", "\n", "hmm", "<", "/", "think"]
    for markers in (MULTI, SINGLE, {"start": "[[", "end": "]]"}):
        for _ in range(3):
            engine = make_tiny_engine(reasoning=markers)
            thought = " ".join(rng.choice(words) for _ in range(rng.randint(0, 40)))
            thought = thought.replace(markers["end"], "")
            seen = []
            answer_ids = scripted(engine, thought, ANSWER, markers["end"], seen)
            budget = rng.choice([None, 0, 3, 12, 50])
            chunks, final = run(engine, thinking_token_budget=budget,
                                max_tokens=rng.choice([40, 80, 120]))
            answer = "".join(c.text for c in chunks)
            assert final.validation == "valid", (markers, thought, budget, answer)
            jsonschema.validate(json.loads(answer), PERSON)
            # every token a matcher accepted is an answer token, in order
            out = [t for c in chunks for t in c.token_ids]
            answer_part = out[final.reasoning_tokens:]
            assert seen[:len(answer_part)] == answer_part[:len(seen)]
            assert len(seen) <= len(answer_part) + 1
            del answer_ids


def test_thinking_views():
    th = Thinking(ReasoningMarkers(), [1, 2, 3], 100)
    out = "".join(th.feed(piece) for piece in ["<th", "ink>\n", "Hi ", "there", "\n</", "thi"])
    assert out == "Hi there" and not th.done
    assert th.feed("nk>\n\n") == "" and th.done
    th = Thinking(ReasoningMarkers(), [1], 100)
    assert th.feed("  <b>x</") == "<b>x"  # '</' could begin '</think>': held
    assert th.feed("b>", final=True) == "</b>"
    with pytest.raises(ValueError, match="unknown key"):
        ReasoningMarkers.parse({"begin": "<x>"})
    with pytest.raises(ValueError, match="non-empty"):
        ReasoningMarkers.parse({"end": " "})
    assert ReasoningMarkers.parse(True) == ReasoningMarkers()
    decode = "".join
    assert thought_end(decode, list("ab</think>cd"), "</think>") == 10
    assert thought_end(decode, list("ab</thi"), "</think>") is None


def test_markers_from_the_chat_template(make_engine, default_tokenizer):
    """A template that writes <think> ... </think> turns the phase on; false turns it off."""
    saved = default_tokenizer.chat_template
    default_tokenizer.chat_template = saved + "{# <think> ... </think> #}"
    try:
        assert make_engine().guide.reasoning == ReasoningMarkers()
        assert make_engine(reasoning=False).guide.reasoning is None
    finally:
        default_tokenizer.chat_template = saved
    assert make_engine().guide.reasoning is None
