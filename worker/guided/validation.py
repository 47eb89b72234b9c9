"""Post-validation of finished JSON outputs against their full schema.

xgrammar's grammar for a JSON schema is looser than the schema in places (``allOf`` and
``oneOf`` taken as ``anyOf``, ``not``, ``if``/``then``, ``uniqueItems``, ``contains``,
``dependentRequired`` ignored, a ``pattern`` combined with a length bound or using
lookaround only approximated), so a finished output can pass the grammar and still break
the schema. The engine validates each finished json_schema / json_object output once, at
finish (not in the step loop), and reports the outcome on the final ``RequestOutput``:
``validation`` ("valid" / "invalid"), ``validation_error`` and ``approximated`` (the schema
keywords the grammar only approximates, found by inspecting the schema).

The validator is jsonschema-rs (Rust): it builds a validator for a small schema in tens of
microseconds and validates in a few, supports drafts 4 to 2020-12 (pydantic's ``$defs``)
and never executes generated code. fastjsonschema validates about as fast once built, but
builds by generating and ``exec``-ing Python source (milliseconds per new schema) and stops
at draft 7. Figures: docs/benchmarks.md, "Conformance".

``format`` is checked, not left an annotation (jsonschema-rs's default, as draft 2020-12
says): every format jsonschema-rs knows, whatever the schema's draft, plus draft 3's
``host-name`` and ``ip-address``. Where an engine's own grammar for a format is wider than
this check (``email``, ``hostname``, ``date`` ...), grammar_cache/format_patterns.py writes
the format as a pattern of what the check accepts. xgrammar writes a plain string for
some formats (``iri``, ``regex`` ...: ``format: <name>`` in ``approximated``, checked
here); a format nothing knows (a custom one, OpenAPI's ``int32``) is listed as
``format: <name> (not checked)``, so an output is never called valid over a format that
nobody checked.

``validate_json(schema, text)`` lives in core/json_validation.py (the edge validates
tool-call arguments with it) and is re-exported here.
"""

from __future__ import annotations

import json
import re

from core.json_schema import walk
# validate_json (and the validator schema_rewrites.py builds) live in core, for the edge
from core.json_validation import CHECKED_FORMATS as _CHECKED_FORMATS
from core.json_validation import validate_json  # noqa: F401 - re-exported
from core.json_validation import validator as _validator  # noqa: F401 - re-exported
from grammar_cache.format_patterns import (XGRAMMAR_NATIVE_FORMATS, named_properties,
                                           takes_any_string)

# the formats xgrammar enforces with a grammar of its own (probed: a schema with only
# that format refuses a malformed string) or with the pattern that
# grammar_cache/format_patterns.py writes for it (the IDN ones and draft 3's as their ASCII
# subset); it writes any other as a plain string
_XGRAMMAR_FORMATS = frozenset((
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
    "uri-reference", "uuid", "uri-template", "json-pointer", "relative-json-pointer",
    "idn-email", "idn-hostname", "host-name", "ip-address"))
NOT_CHECKED = " (not checked)"  # the mark of a format nothing checks, in ``approximated``


# keywords xgrammar 0.2.8 drops or widens (probed one by one: a grammar built from a
# schema with only that keyword accepts an instance the schema rejects)
# beside a ``pattern``, a format xgrammar writes itself is left out of its grammar (and a
# pattern that takes any string is left out instead; grammar_cache/format_patterns.py,
# ``XGRAMMAR_NATIVE_FORMATS``): the format is approximated, the pattern not
_WIDENED = ("allOf", "oneOf", "not", "if", "then", "else", "dependentRequired",
            "dependentSchemas", "uniqueItems", "contains", "minContains", "maxContains",
            "unevaluatedItems")
_LOOKAROUND = re.compile(r"\(\?[=!<]|\\[1-9]")


def approximated_keywords(schema) -> list[str]:
    """The keywords of ``schema`` (a dict or JSON text) that xgrammar's grammar only
    approximates, sorted; validation is what enforces them, except the formats marked
    NOT_CHECKED, which nothing enforces."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            return []
    found: set[str] = set()
    for sub in walk(schema, max_depth=64, lenient=True):
        if isinstance(sub.node, dict):
            node_approximated(sub.node, found, schema)
    return sorted(found)


def node_approximated(node: dict, found: set[str], root=None) -> None:
    """Adds to ``found`` what of ``approximated_keywords`` one schema node holds itself
    (not its subschemas); ``root``: the schema the node is in (its references)."""
    if "propertyNames" in node and named_properties(node, root) is None:
        found.add("propertyNames")  # xgrammar takes any key; written out where it can be
    for key in _WIDENED:
        if key in node:
            found.add(key)
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        if "minLength" in node or "maxLength" in node:
            found.add("pattern with minLength/maxLength")
        if _LOOKAROUND.search(pattern):
            found.add("pattern lookaround/backreference")
        if not (pattern.startswith("^") and pattern.endswith("$")):
            found.add("pattern without ^...$ anchors")
    fmt = node.get("format")
    if isinstance(fmt, str):
        anything = (isinstance(pattern, str) and fmt in XGRAMMAR_NATIVE_FORMATS
                    and takes_any_string(pattern))
        if fmt not in _CHECKED_FORMATS:
            found.add(f"format: {fmt}{NOT_CHECKED}")
        elif anything:
            pass  # the pattern takes any string: the format's grammar is kept
        elif fmt not in _XGRAMMAR_FORMATS or isinstance(pattern, str):
            found.add(f"format: {fmt}")
    multiple = node.get("multipleOf")
    if multiple is not None and not (isinstance(multiple, int) or (
            isinstance(multiple, float) and multiple.is_integer())):
        found.add("multipleOf")  # fractional, or not a number at all (validation says so)


def not_checked(approximated: list[str]) -> list[str]:
    """What of ``approximated`` nothing enforces (the formats no one knows): what stays
    true of an output of an engine that enforces the rest exactly (llguidance)."""
    return [k for k in approximated if k.endswith(NOT_CHECKED)]
