"""llguidance's state key for the closing search (worker/guided/llguidance_backend.py: LLGuidanceMatcher): two
places that look alike from inside (the same mask, forced bytes and probe runs) but have
different fields of a pattern still to come are told apart, so the closing search does
not merge them and cut off the only way to close (JSONSchemaBench's Snowplow schemas: an
answer cut by its loop guard inside ``iglu:a/b/c/1-0-0`` came back unterminated)."""

import pytest

from core.grammar_spec import GrammarSpec
from worker.guided.llguidance_backend import LLGuidanceMatcher, _llguidance_grammar, _run_probes

pytestmark = pytest.mark.unit

llguidance = pytest.importorskip("llguidance")
BYTES = llguidance.LLTokenizer("byte")
PATTERN = "iglu:[a-zA-Z0-9-_.]+/[a-zA-Z0-9-_]+/[a-zA-Z0-9-_]+/[0-9]+-[0-9]+-[0-9]+"


def key_after(text: str) -> tuple:
    inner = llguidance.LLMatcher(BYTES, _llguidance_grammar(GrammarSpec.regex(PATTERN)),
                                 log_level=0)
    m = LLGuidanceMatcher(inner, frozenset(BYTES.eos_tokens), BYTES, _run_probes(BYTES))
    assert all(m.accept_token(t) for t in BYTES.tokenize_str(text)), text
    return m.state_key()


@pytest.mark.parametrize("first, second", [
    ("iglu:a/b/c/1000", "iglu:a/b/c/1000-1"),    # digit groups: two "-0" to come, or one
    ("iglu:a/b/c/1-0", "iglu:a/b/c/1-0-0"),
    ("iglu:a/bcd", "iglu:a/bcd/ef"),              # name fields: "/a" twice more, or once
])
def test_fields_that_look_alike_are_told_apart(first, second):
    assert key_after(first) != key_after(second)


def test_one_field_keeps_one_key():
    """Inside one field every place is the same state (or free text would never merge)."""
    assert key_after("iglu:a/bcd/ef") == key_after("iglu:a/bcd/efgh")
