"""Stop strings in a guided request: honoured only where the grammar may end, and checked in
time linear in the output (one matcher advanced as text is emitted; a candidate costs only
the characters after it), whatever the number of stop occurrences."""

from __future__ import annotations

import random

import pytest
import xgrammar as xgr

from worker.guided.detokenizer import GrammarStopCheck, IncrementalDetokenizer

pytestmark = pytest.mark.unit


class CharTokenizer:
    """Token id = code point: every token is one character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


@pytest.fixture(scope="module")
def compiler():
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])
    return xgr.GrammarCompiler(info)


class CountingMatcher:
    """An xgrammar matcher that counts the characters it is asked to parse."""

    made = 0

    def __init__(self, compiled):
        CountingMatcher.made += 1
        self.inner = xgr.GrammarMatcher(compiled)
        self.chars = 0

    def accept_string(self, text: str) -> bool:
        self.chars += len(text)
        return self.inner.accept_string(text)

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def rollback(self, n: int) -> None:
        self.inner.rollback(n)


def naive_accepts(compiled, text: str) -> bool:
    """The reference: a fresh matcher over the whole output before the stop."""
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string(text) and m.is_completed()


def stream(text: str, stop, check=None, chunk=1, resumed: str = "") -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(CharTokenizer(), ids("p"), stop=stop,
                                   resumed_token_ids=ids(resumed), resumed_text=resumed)
    detok.stop_check = check
    out = ids(text)
    for i in range(0, len(out), chunk):
        detok.add_tokens(out[i:i + chunk])
        if detok.stopped:
            break
    detok.flush()
    return detok


@pytest.mark.parametrize("chunk", [1, 7])
def test_many_refused_stop_occurrences_cost_linear_work(compiler, chunk):
    # every "," is a stop occurrence the grammar refuses to end at (it must end with "b")
    compiled = compiler.compile_regex(r"(a,)*b")
    output = "a," * 3000 + "b"
    CountingMatcher.made = 0
    matcher = CountingMatcher(compiled)
    detok = stream(output, [","], GrammarStopCheck(matcher), chunk=chunk)
    assert detok.stopped is None and detok.text == output
    assert CountingMatcher.made == 1  # one matcher for the whole request
    # each character parsed about once (committed) plus the few after the last commit per
    # candidate; a matcher rebuilt per occurrence parses ~3000**2 characters
    assert matcher.chars <= 3 * len(output), matcher.chars


def test_a_stop_is_honoured_where_the_grammar_may_end(compiler):
    compiled = compiler.compile_regex(r"[0-9]+(,[0-9]+)*")
    detok = stream("12,34,56", [","], GrammarStopCheck(CountingMatcher(compiled)))
    assert detok.stopped == "," and detok.text == "12"
    # a stop inside a JSON string is not where the grammar may end
    compiled = compiler.compile_json_schema('{"type": "object", "properties": {"city": '
                                            '{"type": "string"}}, "required": ["city"]}')
    detok = stream('{"city": "Paris"}', ['"'], GrammarStopCheck(CountingMatcher(compiled)))
    assert detok.stopped is None and detok.text == '{"city": "Paris"}'


def test_output_the_grammar_refused_honours_no_stop(compiler):
    compiled = compiler.compile_regex(r"[0-9]+")
    check = GrammarStopCheck(CountingMatcher(compiled))
    detok = stream("x1,2,", [","], check)
    assert detok.stopped is None and detok.text == "x1,2,"
    assert not check.accepts("")


@pytest.mark.parametrize("seed", range(30))
def test_same_answer_as_a_fresh_matcher_per_occurrence(compiler, seed):
    rng = random.Random(seed)
    compiled = compiler.compile_regex(r"(ab|a|b,)+(;c)?")
    output = "".join(rng.choice(["ab", "a", "b,", ";c", "b"]) for _ in range(rng.randint(1, 30)))
    stops = rng.sample(["b", "a", ",", ";", "ab", "b,a", ";c", "aab"], rng.randint(1, 3))
    chunk = rng.randint(1, 5)
    resumed = output[:rng.randint(0, 3)] if rng.random() < 0.3 else ""
    rest = output[len(resumed):]
    got = stream(rest, stops, GrammarStopCheck(CountingMatcher(compiled)), chunk, resumed)
    want = IncrementalDetokenizer(CharTokenizer(), ids("p"), stop=stops,
                                  resumed_token_ids=ids(resumed), resumed_text=resumed)
    # the reference check: the whole output so far, through a fresh matcher
    want._stop_check = _Naive(compiled, want)
    out = ids(rest)
    for i in range(0, len(out), chunk):
        want.add_tokens(out[i:i + chunk])
        if want.stopped:
            break
    want.flush()
    assert (got.text, got.stopped) == (want.text, want.stopped), (output, stops, chunk)


class _Naive:
    """The check as it was: a fresh matcher over everything before the candidate."""

    def __init__(self, compiled, detok):
        self.compiled, self.detok = compiled, detok

    def commit(self, text):
        pass

    def accepts(self, tail):
        return naive_accepts(self.compiled, self.detok._before + self.detok._text + tail)
