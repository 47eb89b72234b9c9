"""``format`` in post-validation (worker/guided/validation.py): checked, never an annotation
an output is called valid over unchecked.

- every format jsonschema-rs knows is checked, whatever the schema's draft;
- those xgrammar writes as a plain string (iri, regex ...) are listed in
  ``approximated`` (validation is what enforces them), and the list matches what xgrammar
  does (a probe: an xgrammar upgrade that changes it fails here);
- a format nothing knows is listed as not checked, on llguidance's outputs too.
"""

import json

import pytest

from worker.guided import validation
from worker.guided.validation import approximated_keywords, not_checked, validate_json

pytestmark = pytest.mark.unit

# a malformed string per format, and a well-formed one
SAMPLES = {
    "date-time": ("yesterday", "2024-01-02T03:04:05Z"), "date": ("x", "2024-01-02"),
    "time": ("x", "03:04:05Z"), "duration": ("x", "P1D"), "email": ("nope", "a@b.co"),
    "idn-email": ("nope", "a@b.co"), "hostname": ("-a-", "example.com"),
    "idn-hostname": ("-a-", "example.com"), "ipv4": ("1.2.3", "1.2.3.4"),
    "ipv6": ("x", "::1"), "uri": ("x y", "https://a.b/c"),
    "uri-reference": ("\\\\", "/c"), "iri": ("nope", "https://a.b/c"),
    "iri-reference": ("\\\\", "/c"), "uuid": ("x", "123e4567-e89b-12d3-a456-426614174000"),
    "uri-template": ("{", "/a/{b}"), "json-pointer": ("x", "/a/b"),
    "relative-json-pointer": ("x", "0/a"), "regex": ("((", "a+"),
    "host-name": ("-a-", "example.com"), "ip-address": ("1.2.3", "1.2.3.4"),
}
DRAFTS = [None, "https://json-schema.org/draft/2020-12/schema",
          "https://json-schema.org/draft/2019-09/schema",
          "http://json-schema.org/draft-07/schema#", "http://json-schema.org/draft-06/schema#",
          "http://json-schema.org/draft-04/schema#"]


def schema(fmt, draft=None):
    s = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}},
         "required": ["v"]}
    if draft:
        s["$schema"] = draft
    return s


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_every_known_format_is_checked(fmt, draft):
    bad, good = SAMPLES[fmt]
    error = validate_json(schema(fmt, draft), json.dumps({"v": bad}))
    assert error is not None and "/v" in error, (fmt, draft, error)
    assert validate_json(schema(fmt, draft), json.dumps({"v": good})) is None


def test_format_applies_to_strings_only():
    assert validate_json({"format": "email"}, "5") is None


@pytest.mark.parametrize("fmt", ["iri", "regex", "iri-reference"])
def test_formats_xgrammar_writes_as_plain_strings_are_approximated(fmt):
    assert approximated_keywords(schema(fmt)) == [f"format: {fmt}"]


@pytest.mark.parametrize("fmt", ["email", "date-time", "uuid", "ipv4", "uri"])
def test_formats_xgrammar_enforces_are_not_listed(fmt):
    assert approximated_keywords(schema(fmt)) == []


@pytest.mark.parametrize("fmt", ["color", "int32", "textarea"])
def test_a_format_nothing_knows_is_listed_as_not_checked(fmt):
    listed = approximated_keywords(schema(fmt))
    assert listed == [f"format: {fmt} (not checked)"]
    assert not_checked(listed + ["not", "format: iri"]) == listed  # kept on llguidance
    assert validate_json(schema(fmt), '{"v": "anything"}') is None


def test_a_property_named_format_is_not_a_format():
    s = {"type": "object", "properties": {"format": {"type": "string"}}}
    assert approximated_keywords(s) == []


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_xgrammar_enforces_exactly_the_formats_listed_as_enforced(fmt):
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from grammar_cache.compile import json_schema_ebnf

    grammar = xgr.Grammar.from_ebnf(json_schema_ebnf(json.dumps({"type": "string",
                                                                  "format": fmt})))
    accepts_bad = _is_grammar_accept_string(grammar, json.dumps(SAMPLES[fmt][0]))
    assert accepts_bad == (fmt not in validation._XGRAMMAR_FORMATS), fmt


# a string no format accepts (an unclosed group: not a regex either): where xgrammar
# reads the pattern, only it is accepted
ODD, ODD_PATTERN = "<a b>(", r"^<a b>\($"


@pytest.mark.parametrize("fmt", sorted(SAMPLES))
def test_xgrammar_reads_the_pattern_beside_every_format(fmt):
    # beside its own formats' grammars xgrammar leaves a pattern out (JSONSchemaStore's
    # schema-catalog: "format": "uri", "pattern": "^https://" answered a uri without the
    # https, at its budget); the rewrite for xgrammar leaves the format out there instead,
    # so the grammar reads the pattern beside every format, and the format is listed
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from grammar_cache.compile import json_schema_ebnf

    node = {"type": "string", "format": fmt, "pattern": ODD_PATTERN}
    grammar = xgr.Grammar.from_ebnf(json_schema_ebnf(json.dumps(node)))
    assert _is_grammar_accept_string(grammar, json.dumps(ODD)), fmt
    listed = approximated_keywords({"type": "object", "properties": {"v": node}})
    assert listed == [f"format: {fmt}"], (fmt, listed)
    # the answer is checked against both all the same
    assert validate_json(node, json.dumps(ODD)) is not None
