"""The loop guard's own cost (worker/guided/loop_guard.py): bounded work and memory per
token where it finds a loop it may not cut (a ``minLength`` string of one character, a
deep nesting), and nothing recorded while it is off. Work is counted as the Python lines
the guard runs (deterministic), memory with tracemalloc; no wall time.

A tiny hand-made vocabulary: no model or tokenizer needed."""

import sys
import tracemalloc

import pytest

from core.params import LoopGuardParams
from worker.guided.loop_guard import LoopGuard, closer_ids, token_shapes

pytestmark = pytest.mark.unit

VOCAB = [b"{", b'"s": "', b"a", b'"', b"]", b"}", b"[", b",", b"1", b" ", b"ab", b". "]
OPEN, KEY, A, QUOTE, RBRACK, RBRACE, LBRACK, COMMA, ONE, SPACE, AB, STOP = range(len(VOCAB))


def guard(params=LoopGuardParams()):
    return LoopGuard(params, VOCAB, closer_ids(VOCAB), token_shapes(VOCAB))


def never(keep, closers):  # the grammar demands more (minLength, minItems, a deep shape)
    return False


def lines_per_token(tokens, params=LoopGuardParams()):
    """The guard's Python lines run per token, pushing ``tokens`` and looking for a loop
    after each (as OutputPolicy.after_token does), where no cut is ever allowed."""
    g = guard(params)
    source = sys.modules[LoopGuard.__module__].__file__
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename != source:
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
