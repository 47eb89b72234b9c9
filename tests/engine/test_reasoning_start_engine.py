"""Where a reasoning model's request starts, read from its rendered prompt
(worker/guided/reasoning.py prompt_thought: in a thought only where the prompt, or a chat
template's assistant turn, ends inside an open one), and the answer text that shares the
end marker's token (unguided: content; guided: the grammar's first text, or dropped when
the grammar refuses it). The tiny model (the default model's tokenizer) with scripted
logits plays the reasoning
model (markers from the config, several tokens each in its vocabulary)."""

import pytest

from core.grammar_spec import GrammarSpec
from core.params import SamplingParams
from worker.guided.reasoning import (CLOSED, OPEN, ReasoningMarkers, opens_thought,
                                     prompt_thought, split_marker_token)
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

    engine.drafter = None  # its logits are scripted one row a sampling row: no drafts
    engine.runner.run = run_scripted
    return ids


def script_text(engine, ids: list[int]) -> None:
    """The model means to write the text of ``ids``: where its output's text is the text
    of a prefix of ``ids`` it takes the next one; where the output is still a prefix of
    that text (the engine replaced a token by others with the same text) the first token
    of the rest; else EOS."""
    tok = engine.tokenizer
    eos = sorted(engine.eos_ids)[0]
    whole = tok.decode(ids, skip_special_tokens=False)
    after = {tok.decode(ids[:k], skip_special_tokens=False): ids[k] for k in range(len(ids))}
    run = engine.runner.run

    def run_scripted(scheduled):
        logits, rows = run(scheduled)
        logits = logits.clone()
        for i, seq in enumerate(s.seq for s in scheduled if s.samples):
            out = tok.decode(seq.output_ids, skip_special_tokens=False)
            nxt = after.get(out)
            if nxt is None and whole.startswith(out) and len(out) < len(whole):
                nxt = tok(whole[len(out):], add_special_tokens=False)["input_ids"][0]
            logits[i] = 0.0
            logits[i, eos if nxt is None else nxt] = 100.0
        return logits, rows

    engine.drafter = None  # its logits are scripted one row a sampling row: no drafts
    engine.runner.run = run_scripted


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
    final = chunks[-1]
    final.all_token_ids = [t for c in chunks for t in c.token_ids]
    return text, reasoning, final


CHAT = [{"role": "user", "content": "Name a person."}]


def test_prompt_thought_and_opens_thought():
    m = ReasoningMarkers()
    assert prompt_thought("Q?\n<think>\n", m) == OPEN
    assert prompt_thought("Q?\n<think>\nhm</think>\n\n", m) == CLOSED
    assert prompt_thought("old <think>a</think> turn, new <think>", m) == OPEN
    assert prompt_thought("no markers here", m) is None
    assert opens_thought("  <think>", "<think>") and opens_thought("<think>Hm", "<think>")
    assert opens_thought("\n\n", "<think>") is None and opens_thought("<th", "<think>") is None
    assert opens_thought("<b>", "<think>") is False
    assert opens_thought("Ada", "<think>") is False
    decode = "".join  # one character a token
    assert split_marker_token(decode, list("ab</think>"), "</think>") == (">", "")
    assert split_marker_token(decode, list("ab</think") + ['>"'], "</think>") == (">", '"')
    assert split_marker_token(decode, list("ab</think>") + ["x"], "</think>") is None


def test_a_completion_prompt_that_closed_the_thought_starts_in_the_answer(make_tiny_engine):
    engine = make_tiny_engine(reasoning=MARKERS)
    script(engine, "Ada Lovelace.")
    text, reasoning, final = run(engine, "Q: name a person.\n<think>\nEasy.\n</think>\n\n")
    assert text == "Ada Lovelace." and reasoning == ""
    assert not final.reasoning_tokens


def test_a_guided_request_whose_prompt_closed_the_thought_is_guided_at_once(make_tiny_engine):
    engine = make_tiny_engine(reasoning=MARKERS)
    script(engine, '{"name": "Ada"}')
    text, reasoning, final = run(engine, "Q\n<think>\n</think>\n", schema=PERSON)
    assert text == '{"name": "Ada"}' and reasoning == ""
    assert final.validation == "valid"


def test_a_direct_answer_to_a_prompt_without_markers_is_the_answer(make_tiny_engine):
    """A chat template that opened no thought: the model answers at once."""
    engine = make_tiny_engine(reasoning=MARKERS)
    script(engine, "Ada Lovelace.")
    text, reasoning, final = run(engine, CHAT)
    assert text == "Ada Lovelace." and reasoning == ""
    assert not final.reasoning_tokens


def test_a_guided_chat_whose_template_opens_no_thought_is_guided_at_once(make_tiny_engine):
    """The default template's assistant turn holds no marker: the answer is under the
    grammar from its first token (it used to think, so the answer became the thought)."""
    engine = make_tiny_engine(reasoning=MARKERS)
    script(engine, '{"name": "Ada"}')
    text, reasoning, final = run(engine, CHAT, schema=PERSON)
    assert text == '{"name": "Ada"}' and reasoning == ""
    assert final.validation == "valid" and not final.reasoning_tokens


def test_a_marker_quoted_in_a_message_opens_no_thought(make_tiny_engine):
    """A chat is judged by what its template appends for the assistant's turn, not by a
    marker a message happens to hold."""
    engine = make_tiny_engine(reasoning=MARKERS)
    script(engine, "A tag.")
    chat = [{"role": "user", "content": "What does <think> mean in a prompt?"}]
    text, reasoning, final = run(engine, chat)
    assert text == "A tag." and reasoning == "" and not final.reasoning_tokens


# a template that drops earlier thoughts (so it names the markers: from_template turns
# the phase on) and, optionally, opens one for the assistant's turn
TEMPLATE = ("{# earlier thoughts (<think> ... </think>) are dropped #}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{{ m['content'].split('</think>')[-1] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{OPEN}{% endif %}")


@pytest.fixture
def template(default_tokenizer):
    saved = default_tokenizer.chat_template

    def use(opens: bool):
        default_tokenizer.chat_template = TEMPLATE.replace("{OPEN}",
                                                           "<think>\n" if opens else "")

    yield use
    default_tokenizer.chat_template = saved


def test_a_template_that_names_the_markers_but_opens_none_answers_at_once(make_tiny_engine,
                                                                          template):
    template(opens=False)
    engine = make_tiny_engine()  # the markers come from the template
    assert engine.guide.reasoning == ReasoningMarkers()
    script(engine, '{"name": "Ada"}')
    chat = [{"role": "user", "content": "Name one."},
            {"role": "assistant", "content": "<think>x</think>Bob"},
            {"role": "user", "content": "Another."}]
    text, reasoning, final = run(engine, chat, schema=PERSON)
    assert text == '{"name": "Ada"}' and reasoning == "" and final.validation == "valid"


def test_a_template_that_opens_the_thought_thinks_first(make_tiny_engine, template):
    template(opens=True)
    engine = make_tiny_engine()
    script(engine, 'Someone famous.</think>{"name": "Ada"}')
    text, reasoning, final = run(engine, CHAT, schema=PERSON)
    assert reasoning == "Someone famous." and text == '{"name": "Ada"}'
    assert final.validation == "valid" and final.reasoning_tokens > 0


@pytest.mark.parametrize("output", ["<think>Someone famous.</think>Ada.",
                                    "\n<think>\nSomeone famous.\n</think>\nAda."])
def test_a_thought_the_model_opens_itself_is_a_thought(make_tiny_engine, output):
    """Unguided, no marker in the prompt: an output that opens a thought is one."""
    engine = make_tiny_engine(reasoning=MARKERS)
    script(engine, output)
    text, reasoning, final = run(engine, CHAT)
    assert reasoning == "Someone famous." and text.strip() == "Ada."


@pytest.mark.parametrize("output", ["<b>Ada</b>", "\n\n<html>Ada", "<", "\n<th>Ada</th>"])
def test_an_output_that_only_begins_like_the_marker_is_the_answer(make_tiny_engine, output):
    """'<' may begin '<think>': held back until the output's text decides, then streamed
    whole as the answer (it used to stay a thought for ever, or lose that '<')."""
    engine = make_tiny_engine(reasoning=MARKERS)
    script(engine, output)
    text, reasoning, final = run(engine, CHAT)
    assert text == output and reasoning == "" and not final.reasoning_tokens


def test_a_prompt_that_opened_the_thought_starts_in_it(make_tiny_engine):
    engine = make_tiny_engine(reasoning=MARKERS)
    script(engine, "Someone famous.</think>Ada.")
    text, reasoning, final = run(engine, "Q: name a person.\n<think>\n")
    assert reasoning == "Someone famous." and text == "Ada."
    assert final.reasoning_tokens > 0


def test_text_after_the_marker_in_its_token_is_kept(make_tiny_engine):
    """'</think>' ends on a token that goes on ('>"'): that quote is the answer's."""
    engine = make_tiny_engine(reasoning=MARKERS)
    tok = engine.tokenizer
    vocab = tok.get_vocab()
    assert '>"' in vocab  # the default model's vocabulary has it
    ids = (tok("Hm.</think", add_special_tokens=False)["input_ids"] + [vocab['>"']]
           + tok('Ada"', add_special_tokens=False)["input_ids"])
    script(engine, "", ids)
    text, reasoning, _ = run(engine, "Q: quote a name.\n<think>\n")
    assert reasoning == "Hm." and text == '"Ada"'


def marker_with_a_quote(engine) -> list[int]:
    """'Hm.</think' then '>"' (the marker's end and a quote in one token), then 'Ada"'."""
    tok = engine.tokenizer
    return (tok("Hm.</think", add_special_tokens=False)["input_ids"]
            + [tok.get_vocab()['>"']] + tok('Ada"', add_special_tokens=False)["input_ids"])


def test_a_guided_answer_keeps_the_text_after_the_marker_in_its_token(make_tiny_engine):
    """The grammar accepts the quote: it is the answer's first text, fed to the matcher
    (it used to be dropped, and the answer went on from the model's next token)."""
    engine = make_tiny_engine(reasoning=MARKERS)
    script_text(engine, marker_with_a_quote(engine))
    text, reasoning, final = run(engine, "Q: quote a name.\n<think>\n",
                                 schema={"type": "string"})
    assert reasoning == "Hm." and text == '"Ada"' and final.validation == "valid"
    # the tokens say what the client got: the bare marker, then the answer's tokens
    said = engine.tokenizer.decode(final.all_token_ids, skip_special_tokens=True)
    assert said == 'Hm.</think>"Ada"'


def test_a_tail_the_grammar_refuses_is_dropped_with_its_token(make_tiny_engine):
    """An object's answer cannot begin with the quote: the token becomes the bare marker
    (the model's context is what the client got) and the answer, sampled under the mask
    from there, validates."""
    engine = make_tiny_engine(reasoning=MARKERS)
    script_text(engine, marker_with_a_quote(engine))
    text, reasoning, final = run(engine, "Q: quote a name.\n<think>\n", schema=PERSON)
    assert reasoning == "Hm." and final.validation == "valid"
    assert text.lstrip().startswith("{")
    said = engine.tokenizer.decode(final.all_token_ids, skip_special_tokens=True)
    assert said == "Hm.</think>" + text
