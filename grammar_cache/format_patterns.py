"""String ``format`` s as patterns that only match what the post-validation accepts.

Both engines' own grammars for some formats are wider than jsonschema-rs (the validator
of worker/guided/validation.py), so an answer written under them, at its budget or freely,
can come back ``invalid`` (probed on xgrammar 0.2.8, llguidance 1.9.1, jsonschema-rs 0.60):

- ``email``: a label with ``--`` at its 3rd-4th characters (``xn--abc``: punycode the
  validator refuses; both engines); a local part over 64 characters (a model's runaway
  ``123-456-7890000123...`` at its budget), a domain label over 63 and a domain over 253;
- ``hostname``: the same labels and length (a label over 63 on xgrammar only);
- ``date`` / ``date-time``: February 29th of a year that is not a leap year (both),
  a day past its month's end (``2024-04-31``, xgrammar); year 0000 is left out too (the
  validator takes it, Python's ``date`` and so pydantic clients refuse it);
- ``time`` / ``date-time``: second 60 that is not a leap second (``12:00:60Z``, both);
- ``ipv4``: a leading zero (``01.2.3.4``, xgrammar), and in an ``ipv6`` 's embedded IPv4
  (``::8.90.02.8``, xgrammar);
- ``json-pointer`` / ``relative-json-pointer``: raw control characters, which are not JSON
  at all (xgrammar; llguidance refuses both formats).

``format_patterns`` writes each of these formats as a ``pattern`` (``^...$``, the same
regex on both engines) that matches a subset of what the validator accepts: long or
punycode labels, leap seconds, quoted local parts and IP-literal domains of e-mail
addresses, local parts of more than 3 dots (or of 2-3 dots and a part over 15 characters,
see ``_LOCAL``) and domains of more than 4 labels are left out, nothing a model needs. ``idn-email`` / ``idn-hostname`` get the
ASCII subset (which the validator accepts as IDN): xgrammar would write a plain string,
llguidance refuses them. The other formats the engines enforce (uuid, uri, uri-reference,
uri-template, duration) matched the validator in the probes: strings sampled at random
from each engine's grammar, at their length bounds (tests/test_format_patterns_unit.py).

Optional parts are written ``{0,1}``, never ``?``: xgrammar 0.2.8 reads an optional group
that ends in a bounded class run as one whose first character may be left out
(``^a(b[0-9]{1,3})?z$`` takes ``a5z``).

A node that has a ``pattern`` of its own keeps its ``format`` as written for llguidance.
For xgrammar (``for_xgrammar``): beside a format xgrammar writes with a grammar of its own
(``XGRAMMAR_NATIVE_FORMATS``) it reads the format and leaves the pattern out (JSONSchemaStore's
schema-catalog: a ``uri`` without the ``^https://`` its pattern asks for), so the format is
left out instead (a pattern that takes any string is left out, the format kept). xgrammar
matches a pattern against the whole string where JSON Schema searches for it (``^https://``
takes only "https://"): a subset, so its answers stay valid, and patterns are left so
(written with ``.*`` at their open ends, a pattern such as cv's ``[A-Z]{2}`` became a
free string the model looped in and could not close at its budget). And ``propertyNames`` (which xgrammar leaves out: any key
passed) whose names are an ``enum`` or ``const`` of strings becomes those names as
``properties``, each with the schema the object gives it (its property, the
``patternProperties`` it matches, or ``additionalProperties``), and no other key (Github_hard
o12460: a ``"description"`` key where only pipette names may be); a node with
``patternProperties`` and no type is typed ``object`` (xgrammar took any value there). The post-validation still
checks the format as the client wrote it. Imports nothing of the other layers: the xgrammar compile (compile.py) and the
llguidance path (worker/guided/llguidance_backend.py) both call it.
"""

from __future__ import annotations

import json
import re

from core.json_schema import DATA_KEYWORDS, SCHEMA_MAPS, resolve_or_none

_X, _H = "[A-Za-z0-9]", "[A-Za-z0-9-]"


def _label(n: int) -> str:
    """A hostname label of 1 to ``n`` (>= 5) letters, digits and hyphens, starting and
    ending with a letter or digit, with no ``--`` at its 3rd and 4th characters."""
    return (f"{_X}({_X}|{_H}({_X}({_H}{{0,{n - 4}}}{_X}){{0,1}}|-{_X}({_H}{{0,{n - 5}}}{_X})"
            "{0,1})){0,1}")


# at most 4 labels, the last of at most 61: 3 * 64 + 61 = 253 characters
_HOSTNAME = f"({_label(63)}\\.){{0,3}}{_label(61)}"
_ATOM = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
# a dot-atom of at most 64 characters (a regex cannot count a run's characters across its
# dots, so as three cases: no dot, one, two or three); the closing search leaves such a
# bounded run by its "@" (closing.py, ``_fresh``), the domain is a hostname
_LOCAL = (f"({_ATOM}{{1,64}}|{_ATOM}{{1,31}}\\.{_ATOM}{{1,32}}"
          f"|({_ATOM}{{1,15}}\\.){{2,3}}{_ATOM}{{1,16}})")
# years 0001-9999: the validator takes year 0000 (RFC 3339), Python's date and so pydantic
# refuse it (a client's `date` field raised ValidationError on "0000-01-01")
_YEAR = "(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]"
         f"|30)|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_OFFSET = "([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]{0,1}[0-9])"


_HEX = "[0-9A-Fa-f]{1,4}"
# the hexadecimal forms only (no embedded IPv4: xgrammar's took "::8.90.02.8", a leading
# zero the validator refuses); "{1,7}" groups around "::" stand for at least one zero group
_IPV6 = "|".join((f"({_HEX}:){{7}}{_HEX}", f"({_HEX}:){{1,7}}:",
                  *(f"({_HEX}:){{1,{n}}}(:{_HEX}){{1,{7 - n}}}" for n in range(6, 0, -1)),
                  f":((:{_HEX}){{1,7}}|:)"))
# a JSON pointer's reference tokens ("~" escaped as ~0 / ~1); xgrammar's own grammar took
# raw control characters (not JSON)
_POINTER = "(/([^~/]|~[01])*)*"


def _time(frac_digits: int) -> str:
    fraction = f"[0-9]{{1,{frac_digits}}}" if frac_digits else "[0-9]+"
    return f"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.{fraction}){{0,1}}{_OFFSET}"


def pattern_for(fmt: str, frac_digits: int = 0) -> str | None:
    """The anchored pattern written for ``format: fmt``, or None where the format is left
    to the engine; ``frac_digits`` bounds a time's fraction of a second (0: unbounded)."""
    body = {"email": f"{_LOCAL}@{_HOSTNAME}", "hostname": _HOSTNAME,
            "date": _DATE, "time": _time(frac_digits),
            "date-time": f"{_DATE}[Tt]{_time(frac_digits)}",
            "ipv4": f"({_OCTET}\\.){{3}}{_OCTET}", "ipv6": f"({_IPV6})",
            "json-pointer": _POINTER,
            "relative-json-pointer": f"(0|[1-9][0-9]{{0,8}})(#|{_POINTER})"}
    body["idn-email"], body["idn-hostname"] = body["email"], body["hostname"]
    body["host-name"], body["ip-address"] = body["hostname"], body["ipv4"]  # draft 3
    return f"^{body[fmt]}$" if fmt in body else None


_REWRITTEN = frozenset(("email", "idn-email", "hostname", "idn-hostname", "host-name",
                        "date", "time", "date-time", "ipv4", "ip-address", "ipv6",
                        "json-pointer", "relative-json-pointer"))
# where a keyword's value is not a schema (a value, or a map of names to schemas)
_VALUES = frozenset(DATA_KEYWORDS)
_MAPS = frozenset((*SCHEMA_MAPS, "dependencies"))
_MAX_DEPTH = 256


# formats xgrammar 0.2.8 writes with a grammar of its own: beside a ``pattern`` it reads the
# format and leaves the pattern out; beside any other format it reads the pattern (probed:
# tests/unit/test_validation_formats_unit.py)
XGRAMMAR_NATIVE_FORMATS = frozenset((
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
    "uri-reference", "uuid", "uri-template", "json-pointer", "relative-json-pointer"))
def takes_any_string(pattern: str) -> bool:
    """Whether ``pattern`` (searched for, as JSON Schema means it) takes every string."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body
    return body in ("", ".*") and not (pattern.startswith("^") and pattern.endswith("$")
                                       and body == "")


def format_patterns(schema, frac_digits: int = 0, for_xgrammar: bool = False):
    """``schema`` (a parsed JSON schema) with each ``format`` of ``_REWRITTEN`` written as
    its ``pattern`` (``pattern_for``), where the node has no ``pattern`` of its own; with
    ``for_xgrammar`` also a format xgrammar writes itself left out beside a pattern,
    ``propertyNames`` of a list of names as properties, and an untyped ``patternProperties``
    node typed object (see the module doc). A new object where something changed; the
    schema itself otherwise."""
    return _rewrite(schema, frac_digits, 0, schema if for_xgrammar else None)


_TYPED_ELSEWHERE = ("properties", "enum", "const", "allOf", "anyOf", "oneOf", "$ref", "not",
                    "if")
_NAME_KEYS = frozenset(("enum", "const", "type", "description", "title", "$comment"))


def named_properties(node: dict, root) -> dict | None:
    """The ``properties`` that say what ``node`` 's ``propertyNames`` says (see the module
    doc), or None where its names are not a plain list of strings or the object cannot be
    written so."""
    names = node.get("propertyNames")
    if isinstance(names, dict) and isinstance(names.get("$ref"), str) and len(names) == 1:
        names = resolve_or_none(root, names["$ref"]) if root is not None else None
    if not isinstance(names, dict) or not set(names) <= _NAME_KEYS:
        return None
    values = names.get("enum", [names["const"]] if "const" in names else None)
    if (not isinstance(values, list) or not values
            or not all(isinstance(v, str) for v in values)):
        return None
    props, patterns = node.get("properties", {}), node.get("patternProperties", {})
    extra = node.get("additionalProperties", True)
    required = node.get("required", [])
    if (not isinstance(props, dict) or not isinstance(patterns, dict)
            or not isinstance(required, list) or not set(required) <= set(values)):
        return None
    out = {}
    for name in values:
        if name in props:
            out[name] = props[name]
            continue
        try:
            matching = [sub for pat, sub in patterns.items() if re.search(pat, name)]
        except (re.error, TypeError):
            return None
        if matching:
            out[name] = matching[0] if len(matching) == 1 else {"allOf": matching}
        elif extra is not False:
            out[name] = extra if isinstance(extra, dict) else {}
    return out


def format_patterns_text(schema: str, frac_digits: int = 0, parsed=None) -> str:
    """``format_patterns`` over schema text: the text itself where no format changes (or
    where it is not JSON: the compile then says what is wrong with it). ``parsed``: the
    text already parsed, where the caller has it."""
    if not any(key in schema for key in ('"format"', '"pattern', '"propertyNames"')):
        return schema
    if parsed is None:
        try:
            parsed = json.loads(schema)
        except (ValueError, RecursionError):
            return schema
    out = format_patterns(parsed, frac_digits, for_xgrammar=True)
    if out is parsed:
        return schema
    try:  # (a number past a double, 1e400, parsed as inf: left as written)
        return json.dumps(out, allow_nan=False)
    except ValueError:
        return schema


def _rewrite(node, frac_digits: int, depth: int, xgr):
    """``xgr``: the schema's root where the rewrite is for xgrammar, else None."""
    if depth > _MAX_DEPTH:
        return node
    if isinstance(node, list):
        items = [_rewrite(sub, frac_digits, depth + 1, xgr) for sub in node]
        return node if all(a is b for a, b in zip(items, node)) else items
    if not isinstance(node, dict):
        return node
    out, changed = {}, False
    for key, value in node.items():
        new = value
        if key in _MAPS and isinstance(value, dict):
            subs = {name: _rewrite(sub, frac_digits, depth + 1, xgr)
                    for name, sub in value.items()}
            if any(subs[name] is not sub for name, sub in value.items()):
                new = subs
        elif key not in _VALUES and isinstance(value, (dict, list)):
            new = _rewrite(value, frac_digits, depth + 1, xgr)
        changed |= new is not value
        out[key] = new
    fmt = node.get("format")
    pattern = node.get("pattern")
    if isinstance(fmt, str) and fmt in _REWRITTEN and "pattern" not in node:
        del out["format"]
        out["pattern"] = pattern_for(fmt, frac_digits)
        changed = True
    elif (xgr is not None and isinstance(pattern, str) and isinstance(fmt, str)
            and fmt in XGRAMMAR_NATIVE_FORMATS):
        # xgrammar reads one of the two: the pattern, unless it takes any string
        del out["pattern" if takes_any_string(pattern) else "format"]
        changed = True
    if (xgr is not None and "patternProperties" in out and "type" not in out
            and not any(k in out for k in _TYPED_ELSEWHERE)):
        # xgrammar reads an untyped node's ``properties`` as an object's but takes any
        # value where it has only ``patternProperties`` (o12460's "labware": a string
        # where each value must be an object): typed as the object it describes
        out["type"] = "object"
        changed = True
    if xgr is not None and "propertyNames" in node:
        named = named_properties(out, xgr)
        if named is not None:
            for key in ("propertyNames", "patternProperties"):
                out.pop(key, None)
            out["properties"], out["additionalProperties"] = named, False
            changed = True
    return out if changed else node
