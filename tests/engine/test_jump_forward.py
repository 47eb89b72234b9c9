"""Jump-forward decoding (issue 31): text a guided row's grammar forces is appended without
sampling. Unit tests of the boundary rules on a hand-made vocabulary; engine tests on the
tiny random-weight model (outputs under a grammar: keys, enums, small numbers)."""

import json

import pytest

from core.grammar_spec import GrammarSpec
from worker.guided.jump_forward import JumpForward
from worker.engine.sampling import SamplingParams
from core.request import GenerationRequest
from worker.guided.validation import validate_json

# --- the boundary rules, on a hand-made vocabulary --------------------------------------

VOCAB = [b"{", b'"', b'{"', b"name", b'":', b' "', b"a", b' "a', b"n", b"ame", b"b"]


def encode(text: str) -> list[int]:
    """Longest match first: the 'tokenizer' of VOCAB."""
    data, ids = text.encode(), []
    while data:
        best = max((i for i, v in enumerate(VOCAB) if data.startswith(v)),
                   key=lambda i: len(VOCAB[i]))
        ids.append(best)
        data = data[len(VOCAB[best]):]
    return ids



def test_the_longer_tokens_are_those_that_begin_with_the_token_in_byte_order():
    # the run of the sorted vocabulary cut out by bisection is the walk's: every token
    # that begins with the head's bytes and is longer, ordered by bytes, here and at
    # 0xff ends (whose run reaches to the vocabulary's end, or stops at the carry)
    vocab = [b"a", b"ab", b"abc", b"b", b"a\xff", b"a\xff\x01", b"\xff", b"\xff\xff",
             b"\xff\x00", b"ac", b"", b"aa", b"b\x00", b"\xfe\xff", b"\xfe\xff\xff"]
    jf = JumpForward(vocab, lambda text: [])
    for token, head in enumerate(vocab):
        want = [i for b, i in sorted((b, i) for i, b in enumerate(vocab) if b)
                if head and b.startswith(head) and len(b) > len(head)]
        assert jf._longer_than(token).tolist() == want, head


def test_the_sorted_vocabulary_is_published_after_its_arrays():
    # GuidedPath.prepare builds it on a thread while the first request may read it: a
    # reader that sees it must find the arrays cut from it (CI failed 7 tests on
    # "'JumpForward' object has no attribute '_sorted_lens'" when it came first)
    order = []

    class Watched(JumpForward):
        def __setattr__(self, name, value):
            if name.startswith("_sorted") and value is not None:
                order.append(name)
            super().__setattr__(name, value)
    Watched(VOCAB, encode).prepare()
    assert order[-1] == "_sorted" and {"_sorted_ids", "_sorted_lens"} <= set(order[:-1])

class LiteralThenLetters:
    """A matcher for ``literal`` followed by any letters a/b (what the interface needs)."""

    def __init__(self, literal: bytes, refuse: tuple[int, ...] = ()):
        self.literal, self.refuse, self.out = literal, refuse, b""
        self.lengths: list[int] = []

    def _fits(self, data: bytes) -> bool:
        full = self.out + data
        head = full[:len(self.literal)]
        return self.literal.startswith(head) and all(c in b"ab" for c in
                                                     full[len(self.literal):])

    def accept_token(self, t: int) -> bool:
        if t in self.refuse or not self._fits(VOCAB[t]):
            return False
        self.out += VOCAB[t]
        self.lengths.append(len(VOCAB[t]))
        return True

    def rollback(self, n: int) -> None:
        for _ in range(n):
            self.out = self.out[:len(self.out) - self.lengths.pop()]

    def find_jump_forward_string(self) -> str:
        return self.literal[len(self.out):].decode()

    def allows(self, t: int) -> bool:  # (what its mask says of t)
        return self._fits(VOCAB[t])

    def fill_next_token_bitmask(self, mask) -> None:
        mask.zero_()
        for t, v in enumerate(VOCAB):
            if self._fits(v):
                mask[0, t >> 5] |= 1 << (t & 31)


LITERAL = b'{"name": "'


def sampled(matcher, token):
    assert matcher.accept_token(token)
    return token


@pytest.mark.unit
def test_the_sampled_token_is_resplit_and_a_mergeable_last_token_held_back():
    m = LiteralThenLetters(LITERAL)
    jump = JumpForward(VOCAB, encode).extend(m, sampled(m, 0), budget=10)
    # '{' + '"name": "' is '{"' 'name' '":' ' "': the sampled '{' is replaced; ' "' is
    # held back because ' "a' (longer, allowed) begins with it: the model writes it
    assert jump.replaces_last and [VOCAB[t] for t in jump.tokens] == [b'{"', b"name", b'":']
    assert jump.added == 2
    assert m.out == b'{"name":'


@pytest.mark.unit
def test_never_hold_back_jumps_to_the_end_of_the_forced_text():
    m = LiteralThenLetters(LITERAL)
    jf = JumpForward(VOCAB, encode, hold_back="never")
    jump = jf.extend(m, sampled(m, 0), budget=10)
    assert [VOCAB[t] for t in jump.tokens] == [b'{"', b"name", b'":', b' "']
    assert m.out == LITERAL and jf.stats.jump_forward_tokens == 3
    assert jf.stats.jump_forward_retokenized == 1


@pytest.mark.unit
def test_a_sampled_token_that_already_splits_well_is_kept():
    m = LiteralThenLetters(LITERAL)
    jump = JumpForward(VOCAB, encode).extend(m, sampled(m, 2), budget=10)  # '{"'
    assert not jump.replaces_last and [VOCAB[t] for t in jump.tokens] == [b"name", b'":']


@pytest.mark.unit
def test_the_budget_caps_the_jump():
    m = LiteralThenLetters(LITERAL)
    jump = JumpForward(VOCAB, encode, hold_back="never").extend(m, sampled(m, 2), budget=1)
    assert jump.added == 1 and [VOCAB[t] for t in jump.tokens] == [b"name"]
    assert JumpForward(VOCAB, encode).extend(m, 3, budget=0) is None


@pytest.mark.unit
def test_a_refused_token_stops_the_jump_and_a_lost_replacement_restores_the_token():
    m = LiteralThenLetters(LITERAL, refuse=(3,))  # 'name' refused: the rest is not tried
    jump = JumpForward(VOCAB, encode).extend(m, sampled(m, 2), budget=10)
    assert jump is None and m.out == b'{"'
    m = LiteralThenLetters(LITERAL, refuse=(2,))  # the replacement '{"' itself refused
    assert JumpForward(VOCAB, encode).extend(m, sampled(m, 0), budget=10) is None
    assert m.out == b"{"  # the sampled token is back in the matcher


@pytest.mark.unit
def test_nothing_forced_no_jump():
    m = LiteralThenLetters(b"{")
    assert JumpForward(VOCAB, encode).extend(m, sampled(m, 0), budget=10) is None


# --- through the engine (tiny model) -----------------------------------------------------

KEYS = [f"key_{c}" for c in "abcdefghijkl"]
KEYS_SCHEMA = {"type": "object", "properties": {
    k: {"enum": ["red", "blue"]} if i % 2 else {"type": "integer", "minimum": 0, "maximum": 9}
    for i, k in enumerate(KEYS)}, "required": KEYS, "additionalProperties": False}
DIGITS = 'root ::= [a-c] "0123456789" [a-c] "9876543210" [a-c]'


@pytest.fixture(scope="module")
def engine_factory(tiny_model_dir):
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine
    from worker.models import loader

    model = loader.load_model(tiny_model_dir, progress=False)
    tokenizer = loader.load_tokenizer(tiny_model_dir)

    def build(**kw) -> LLMEngine:
        kw.setdefault("progress", False)
        kw.setdefault("num_kv_blocks", 256)
        kw.setdefault("jump_forward", True)  # off by default in EngineConfig (for now)
        return LLMEngine(EngineConfig(**kw), model=model, tokenizer=tokenizer,
                         model_dir=tiny_model_dir)

    build.tokenizer = tokenizer
    return build


def chat(text):
    return [{"role": "user", "content": text}]


def req(prompt, grammar=None, n=160, temperature=0.0, **kw):
    return GenerationRequest(chat(prompt), SamplingParams(max_new_tokens=n,
                                                          temperature=temperature,
                                                          seed=kw.pop("seed", None)),
                             grammar=grammar, **kw)


def run(engine, reqs):
    out = engine.generate(reqs)
    return [out[r.request_id] for r in reqs]


def accepted(engine, spec, token_ids) -> bool:
    """Whether a fresh matcher accepts the output's tokens (every one the grammar's)."""
    m = engine.guided.new_matcher(engine.guided.get_grammar(spec).result())
    return all(m.accept_token(t) for t in token_ids if t not in engine.eos_ids)



@pytest.mark.integration
def test_forced_tokens_mid_batch_with_unguided_rows(engine_factory):
    engine = engine_factory()
    spec = GrammarSpec.json_schema(KEYS_SCHEMA)
    reqs = [req(f"Item {i}.", spec) for i in range(3)] + [req("Say hi.", n=12)]
    outs = run(engine, reqs)
    stats = engine.stats()
    assert stats.jump_forward_tokens > 0 and stats.jump_forward_jumps > 0
    for o in outs[:3]:
        assert o.finish_reason == "stop", o
        assert validate_json(KEYS_SCHEMA, o.text) is None
        assert o.completion_tokens == len([t for t in o.token_ids])
        assert accepted(engine, spec, o.token_ids)
        assert o.text == engine.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    assert outs[3].finish_reason in ("length", "stop") and outs[3].completion_tokens <= 12
    # most of a key-heavy object is forced: far fewer samples than output tokens
    guided_tokens = sum(o.completion_tokens for o in outs[:3])
    assert stats.jump_forward_tokens > guided_tokens // 3


@pytest.mark.integration
def test_jump_off_samples_every_token(engine_factory):
    engine = engine_factory(jump_forward=False)
    spec = GrammarSpec.json_schema(KEYS_SCHEMA)
    outs = run(engine, [req("Item 0.", spec)])
    stats = engine.stats()
    assert stats.jump_forward_tokens == 0 and engine.guide.jumper is None
    assert validate_json(KEYS_SCHEMA, outs[0].text) is None
    # every output token sampled, one per step (the closing path aside: none at this budget)
    assert stats.sampled_tokens == outs[0].completion_tokens


@pytest.mark.integration
def test_greedy_equal_with_and_without_jumping_where_the_split_is_unique(engine_factory):
    """Digits are single tokens in this vocabulary: the forced text has one split, so the
    greedy output is the same token for token."""
    spec = GrammarSpec.ebnf(DIGITS)
    outs = {}
    for on in (False, True):
        engine = engine_factory(jump_forward=on)
        outs[on] = run(engine, [req(f"Digits {i}.", spec, n=40) for i in range(3)])
        assert (engine.stats().jump_forward_tokens > 0) == on
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.completion_tokens == b.completion_tokens == 24


@pytest.mark.integration
def test_the_budget_is_never_exceeded(engine_factory):
    engine = engine_factory(closing_window=0)
    spec = GrammarSpec.ebnf('root ::= [a-c] " the quick brown fox jumps over the lazy dog"')
    outs = run(engine, [req("Go.", spec, n=n) for n in (1, 2, 4, 6)])
    for n, o in zip((1, 2, 4, 6), outs):
        assert o.completion_tokens == len(o.token_ids) == n and o.finish_reason == "length"
    # with closing on, a tight budget still ends valid: forced tokens count as output
    engine = engine_factory()
    outs = run(engine, [req(f"Item {i}.", GrammarSpec.json_schema(KEYS_SCHEMA), n=n)
                        for i, n in enumerate((97, 100, 110))])
    for n, o in zip((97, 100, 110), outs):
        assert o.completion_tokens <= n
        assert validate_json(KEYS_SCHEMA, o.text) is None, o.text


@pytest.mark.integration
def test_forced_text_streams_with_its_sampled_token(engine_factory):
    engine = engine_factory()
    spec = GrammarSpec.ebnf(DIGITS)  # no loop guard: nothing is held back from the stream
    r = req("Digits.", spec, n=40)
    engine.add_request(r)
    chunks = []
    while engine.has_work():
        chunks += [c for c in engine.step() if c.request_id == r.request_id]
    sizes = [len(c.token_ids) for c in chunks if c.token_ids]
    assert sizes[:2] == [11, 11]  # a letter and its ten forced digits, in one chunk each
    text = "".join(c.text for c in chunks)
    assert text[1:11] == "0123456789" and len(text) == 23
    # logprobs: forced tokens carry none (rendered as 0.0), sampled ones do
    r = GenerationRequest(chat("Digits."), SamplingParams(max_new_tokens=40, temperature=0.0,
                                                          logprobs=1), grammar=spec)
    out = run(engine, [r])[0]
    lps = out.logprobs
    assert len(lps) == len(out.token_ids)
    assert lps[0] is not None and all(lp is None for lp in lps[1:11])


@pytest.mark.integration
def test_n_samples_and_a_sessions_second_turn(engine_factory):
    engine = engine_factory()
    spec = GrammarSpec.json_schema(KEYS_SCHEMA)
    reqs = [req("Item.", spec, temperature=1.0, seed=7 + i, session_id="s", seq_id=i)
            for i in range(3)]
    outs = run(engine, reqs)
    for o in outs:
        assert validate_json(KEYS_SCHEMA, o.text) is None
    second = GenerationRequest(
        chat("Item.") + [{"role": "assistant", "content": outs[0].text},
                         {"role": "user", "content": "Another."}],
        SamplingParams(max_new_tokens=160, temperature=0.0), session_id="s", grammar=spec)
    out = run(engine, [second])[0]
    assert out.cached_tokens > 0
    assert validate_json(KEYS_SCHEMA, out.text) is None


@pytest.mark.integration
def test_tool_calls_jump_over_the_wrapper(engine_factory):
    from deploy.tools import parse_tool_calls, tool_grammar, with_tool_prompt

    tools = [{"type": "function", "function": {"name": f"get_{n}", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["metric", "imperial"]},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 9}},
        "required": ["unit", "days"]}}} for n in ("weather", "news", "stock")]
    functions, mode, spec = tool_grammar(tools, "required", False)
    engine = engine_factory()
    prompt = with_tool_prompt(chat("Weather?"), functions, mode, "required")
    out = run(engine, [GenerationRequest(prompt, SamplingParams(max_new_tokens=80,
                                                                temperature=0.0),
                                         grammar=spec)])[0]
    _, calls = parse_tool_calls(out.text)
    assert len(calls) == 1, out.text
    assert calls[0]["function"]["name"] in {"get_weather", "get_news", "get_stock"}
    assert set(json.loads(calls[0]["function"]["arguments"])) == {"unit", "days"}
    stats = engine.stats()
    # the wrapper, the name's rest, the keys: most of a call is forced
    assert stats.jump_forward_tokens > out.completion_tokens // 2


@pytest.mark.integration
def test_a_continuation_resumes_over_forced_tokens(engine_factory):
    """A failover's continuation: the tokens streamed before the worker died (forced ones
    among them) are resumed on another engine, and the output ends as it would have."""
    spec = GrammarSpec.json_schema(KEYS_SCHEMA)
    full = run(engine_factory(), [req("Item 0.", spec)])[0]
    cut = 20
    streamed = full.token_ids[:cut]
    before = engine_factory.tokenizer.decode(streamed)
    cont = req("Item 0.", spec, resume_token_ids=streamed, resume_text=before)
    out = run(engine_factory(), [cont])[0]
    assert out.finish_reason == "stop"
    text = before + out.text
    assert validate_json(KEYS_SCHEMA, text) is None
    assert out.completion_tokens == full.completion_tokens or text == full.text
