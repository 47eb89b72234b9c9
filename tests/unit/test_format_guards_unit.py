"""Format runaways: a digit run a JSON-schema ``format`` opens with no bound (the fraction
of a second of a ``date-time`` or ``time``) gets the fraction-digit guard."""

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from grammar_cache.compile import json_schema_ebnf

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("fmt, value", [("date-time", "2024-02-22T12:30:00.{}Z"),
                                        ("time", "12:30:00.{}Z")])
def test_format_fractions_are_bounded(fmt, value):
    schema = json.dumps({"type": "object", "properties": {"t": {"type": "string",
                                                                "format": fmt}}})
    guarded = xgr.Grammar.from_ebnf(json_schema_ebnf(schema, max_frac_digits=9))
    unguarded = xgr.Grammar.from_ebnf(json_schema_ebnf(schema))
    ok, runaway = value.format("123456789"), value.format("0" * 40)
    assert accepts(guarded, json.dumps({"t": ok}))
    assert not accepts(guarded, json.dumps({"t": runaway}))
    assert accepts(unguarded, json.dumps({"t": runaway}))  # max_frac_digits=0: no guard
