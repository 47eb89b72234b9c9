"""The loop guard's own cost (worker/guided/loop_guard.py): bounded work and memory per
token where it finds a loop it may not cut (a ``minLength`` string of one character, a
deep nesting; any text, digits included, at any max_period), and nothing recorded while it
is off. Work is counted as the Python lines the guard's modules run (deterministic; a
numpy operation over the max_period entries is one line), memory with tracemalloc; no
wall time.

A tiny hand-made vocabulary: no model or tokenizer needed."""

import random
import sys
import tracemalloc

import pytest

from core.params import LoopGuardParams
from worker.guided import loop_near, loop_periods
from worker.guided.loop_guard import LoopGuard, closer_ids, token_shapes

pytestmark = pytest.mark.unit

VOCAB = [b"{", b'"s": "', b"a", b'"', b"]", b"}", b"[", b",", b"1", b" ", b"ab", b". "]
OPEN, KEY, A, QUOTE, RBRACK, RBRACE, LBRACK, COMMA, ONE, SPACE, AB, STOP = range(len(VOCAB))
DIGIT = list(range(len(VOCAB), len(VOCAB) + 10))  # one token per digit, as most tokenizers
VOCAB += [str(d).encode() for d in range(10)]
SPACED = list(range(len(VOCAB), len(VOCAB) + 10))  # " 0" ... " 9"
VOCAB += [b" " + str(d).encode() for d in range(10)]


def guard(params=LoopGuardParams()):
    return LoopGuard(params, VOCAB, closer_ids(VOCAB), token_shapes(VOCAB))


def never(keep, closers):  # the grammar demands more (minLength, minItems, a deep shape)
    return False


def lines_per_token(tokens, params=LoopGuardParams()):
    """The guard's Python lines run per token, pushing ``tokens`` and looking for a loop
    after each (as OutputPolicy.after_token does), where no cut is ever allowed."""
    g = guard(params)
    sources = {m.__file__ for m in (sys.modules[LoopGuard.__module__], loop_near, loop_periods)}
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename not in sources:
            return None

        def local(frame, event, arg):
            nonlocal count
            if event == "line":
                count += 1
            return local
        return local

    sys.settrace(tracer)
    try:
        for t in tokens:
            g.push(t)
            g.find(never)
    finally:
        sys.settrace(None)
    return count / len(tokens)


@pytest.mark.parametrize("body", [[A], [AB], [A, SPACE]], ids=["a", "ab", "a-space"])
def test_work_per_token_is_bounded_where_a_repetition_cannot_be_cut(body):
    # a `minLength: 8000` string of one repeated character: every token extends a loop
    # the grammar will not let end; each look used to add up the whole repetition again
    short = lines_per_token([OPEN, KEY] + body * 400)
    long = lines_per_token([OPEN, KEY] + body * 3000)
    assert long < 1.3 * short + 20, (short, long)  # per token: flat, not growing with n
    assert long < 1500, long  # max_period (48) steps twice, plus a few looks


@pytest.mark.parametrize("head, body", [
    ([LBRACK], [QUOTE, AB, SPACE, ONE, QUOTE, COMMA]),  # near copies of an array item
    ([LBRACK], [LBRACK, QUOTE, AB, QUOTE, RBRACK, COMMA]),
    ([OPEN, KEY], [AB, SPACE, AB, SPACE, A, SPACE, ONE, STOP]),  # restarting sentences
], ids=["items", "nested-items", "sentences"])
def test_work_per_token_is_bounded_for_near_repeats_that_cannot_be_cut(head, body):
    short = lines_per_token(head + body * 100)
    long = lines_per_token(head + body * 800)
    assert long < 1.3 * short + 20, (short, long)


def test_work_per_token_is_bounded_in_a_deep_nesting():
    short = lines_per_token([LBRACK] * 400)
    long = lines_per_token([LBRACK] * 3000)
    assert long < 1.3 * short + 20, (short, long)
    # and back out of it: every `]` is one more copy of a loop that closes levels
    out = lines_per_token([LBRACK] * 1500 + [RBRACK] * 1500)
    assert out < 1.3 * short + 40, (short, out)


def digits(n, seed=0, alphabet=DIGIT):
    rng = random.Random(seed)
    return [rng.choice(alphabet) for _ in range(n)]


# texts where every period repeats at once, or many do: every digit token has one shape, so
# a string of digits repeats in shape at every period up to max_period, and each period's
# copies were read on every token (O(max_period^2) a token: 0.26 ms at the defaults)
KINDS = {
    "digit-string": [OPEN, KEY] + digits(1200),  # "pattern": "^[0-9]+$"
    "spaced-digits": [OPEN, KEY] + digits(1200, alphabet=SPACED),
    "number-list": [LBRACK] + [t for d in digits(400) for t in (d, COMMA)],
    "letters": [OPEN, KEY] + [A, AB] * 600,
    "text": [OPEN, KEY] + [random.Random(1).choice([A, AB, SPACE, COMMA, STOP, ONE])
                           for _ in range(1200)],
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_work_per_token_does_not_grow_with_max_period_on_any_text(kind):
    tokens = KINDS[kind]
    small = lines_per_token(tokens, LoopGuardParams(max_period=16))
    default = lines_per_token(tokens)
    widest = lines_per_token(tokens, LoopGuardParams(max_period=256))
    assert widest < 1.2 * small + 20, (small, default, widest)
    assert default < 400 and widest < 400, (default, widest)  # a constant, whatever the text


def test_memory_is_bounded_in_a_deep_nesting():
    # 8,000 tokens of `[[[[`: each token's state kept a copy of the whole nesting
    # (129 MB); now a token costs a few small objects
    g = guard()
    tracemalloc.start()
    try:
        for _ in range(8000):
            g.push(LBRACK)
            g.find(never)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, peak  # about 250 bytes a token at most


@pytest.mark.parametrize("params", [LoopGuardParams(enabled=False),
                                    LoopGuardParams(max_cuts=0)], ids=["off", "no-cuts-left"])
def test_nothing_is_recorded_while_the_guard_is_off(params):
    g = guard(params)
    for t in [OPEN, KEY] + [A] * 100:
        g.push(t)
        assert g.find(never) is None
    assert g.tokens == [] and g.states == []


def test_the_guard_stops_recording_once_its_cuts_are_spent():
    g = guard(LoopGuardParams(max_cuts=1))
    cut = None
    for t in [OPEN, KEY] + [AB] * 40:
        g.push(t)
        cut = g.find(lambda keep, closers: True)
        if cut is not None:
            break
    assert cut is not None
    g.cut(cut.keep, cut.closers)
    assert not g.active
    recorded = len(g.tokens)
    for t in [COMMA, KEY] + [AB] * 40:
        g.push(t)
    assert len(g.tokens) == recorded
