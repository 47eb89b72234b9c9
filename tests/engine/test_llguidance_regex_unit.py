"""A regex means one language on either engine: llguidance's regex reads ``\\d`` and ``\\w``
as Unicode classes, xgrammar (and JSON Schema's ECMA-262 patterns) as ASCII ones, so the
llguidance engine writes them out in ASCII (worker/guided/llguidance_backend.ascii_classes). Checked on a
byte-level tokenizer against Python's ``re`` in ASCII mode."""

import re

import pytest

from core.grammar_spec import GrammarSpec
from worker.guided.llguidance_backend import _llguidance_grammar, ascii_classes

pytestmark = pytest.mark.unit

llguidance = pytest.importorskip("llguidance")
BYTES = llguidance.LLTokenizer("byte")


def accepts(pattern: str, text: str) -> bool:
    m = llguidance.LLMatcher(BYTES, _llguidance_grammar(GrammarSpec.regex(pattern)),
                             log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(BYTES.tokenize_str(text)) and m.is_accepting()


@pytest.mark.parametrize("pattern, texts", [
    (r"\d{3}-\d{3}-\d{4}", ["555-123-4567", "\u0665\u0665\u0665-123-4567", "\uff15\uff15\uff15-123-4567"]),
    (r"\w+", ["abc_9", "\u00e9t\u00e9", "x\u0663"]),
    (r"[\d-]{3}", ["1-2", "\u0663-\u0664"]),
    (r"[^\d]{2}", ["ab", "a\u0663", "a1"]),
    (r"\D\W", ["a-", "\u0663-", "1-", "a\u00e9"]),
    (r"[\D]{2}", ["ab", "\u0663x", "1x"]),
    (r"\\d", ["\\d", "1"]),
    (r"[]\d]", ["]", "5", "\u0665"]),
])
def test_digit_and_word_classes_are_ascii_on_llguidance(pattern, texts):
    for text in texts:
        expected = re.fullmatch(pattern, text, re.ASCII) is not None
        assert accepts(pattern, text) == expected, (pattern, text, expected)


def test_other_parts_of_a_pattern_are_left_as_written():
    assert ascii_classes(r"[a-z]\s\.\p{L}(?:x|y)") == r"[a-z]\s\.\p{L}(?:x|y)"
    assert ascii_classes(r"\d[\d\w]\W") == r"[0-9][0-90-9A-Za-z_][^0-9A-Za-z_]"
    assert ascii_classes(r"[[:alpha:]\d]") == r"[[:alpha:]0-9]"  # a POSIX class stays
    assert accepts(r"[[:alpha:]\d]{2}", "a1") and not accepts(r"[[:alpha:]\d]{2}", "a\u0663")
