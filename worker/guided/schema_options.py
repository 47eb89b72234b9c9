"""A spec's options written into its JSON schema as keywords, for llguidance, which
follows a schema to the letter: xgrammar's strict mode (``strict_schema``: open objects and
tuples closed) and the runaway guards on numbers (``number_guards``, ``any_value_guarded``:
digit bounds as ``minimum`` / ``maximum`` / ``multipleOf``). Unlike schema_rewrites.py these
narrow what the schema allows, as the spec asks; the post-validation still checks the
schema as the client wrote it. The guards run under the rewrite budget (schema_budget.py).
"""

from __future__ import annotations

import json

from core.json_schema import ANNOTATIONS
from worker.guided.schema_budget import RewriteBudget, spend, under_budget

# keywords whose presence beside "properties" / "prefixItems" makes closing the node wrong
# (the extra properties / items may be declared there) or a no-op
_OPEN_OBJECT = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf",
                "anyOf", "oneOf", "$ref", "if", "dependentSchemas")
_OPEN_ARRAY = ("items", "additionalItems", "unevaluatedItems", "allOf", "anyOf", "oneOf",
               "$ref", "if")
# subschemas by how they apply: to other values (a property's, an item's) or to this one
_OTHER_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_OTHER_VALUES = ("items", "prefixItems", "additionalProperties", "additionalItems",
                 "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SAME_LISTS = ("allOf", "anyOf", "oneOf")
_SAME_VALUES = ("then", "else")


def strict_schema(node, merged: bool = False):
    """``node`` with xgrammar's strict mode written into it, for an engine that follows
    the schema to the letter: an object schema with ``properties`` and no word on other
    properties gets ``"additionalProperties": false``, a tuple (``prefixItems``, or a
    draft-4 ``items`` list) with no word on further items gets none allowed.

    A node stays open where another schema applies to the same value and may declare
    more (``merged``: the branches of an ``allOf``, of an ``anyOf`` / ``oneOf`` beside
    ``properties``, ``then`` / ``else``, ``dependentSchemas``), and where a sibling keyword
    may (``allOf``, ``$ref``, ``patternProperties`` ...). ``not`` and ``if`` are left as
    written: closing them would widen what the schema allows."""
    if isinstance(node, list):
        return [strict_schema(n, merged) for n in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _OTHER_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in node[key].items()}
    for key in _OTHER_VALUES:
        if isinstance(node.get(key), (dict, list)):
            out[key] = strict_schema(node[key])
    for key in _SAME_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [strict_schema(sub, merged=merged or key == "allOf" or "properties" in node)
                        for sub in node[key]]
    for key in _SAME_VALUES:
        if isinstance(node.get(key), dict):
            out[key] = strict_schema(node[key], merged=True)
    if isinstance(node.get("dependentSchemas"), dict):
        out["dependentSchemas"] = {name: strict_schema(sub, merged=True)
                                   for name, sub in node["dependentSchemas"].items()}
    if merged:
        return out
    props = node.get("properties")
    if isinstance(props, dict) and not any(k in node for k in _OPEN_OBJECT) and all(
            name in props for name in _named(node)):
        out["additionalProperties"] = False  # (a required key it does not list keeps it open)
    if isinstance(node.get("prefixItems"), list) and not any(k in node for k in _OPEN_ARRAY):
        out["items"] = False
    elif isinstance(node.get("items"), list) and not any(
            k in node for k in ("additionalItems", "unevaluatedItems", "allOf", "$ref")):
        out["additionalItems"] = False
    return out


def _named(node: dict) -> list:
    """The property names ``node`` requires, outright or on a condition (``dependencies``,
    ``dependentRequired``); None for a schema-valued dependency, which may declare more."""
    required = node.get("required")
    names = [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
    for key in ("dependencies", "dependentRequired"):
        if isinstance(node.get(key), dict):
            for name, dep in node[key].items():
                names += [name, *(n if isinstance(n, str) else None for n in dep)] if (
                    isinstance(dep, list)) else [None]
    return names


# --- runaway guards ---------------------------------------------------------------------------

# subschemas that apply to the value itself or to values inside it, where narrowing the
# subschema narrows the whole (not under ``not`` / ``if``, where it would widen it)
_GUARDED_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                 "dependentSchemas")
_GUARDED_VALUES = ("items", "prefixItems", "additionalProperties", "additionalItems",
                   "unevaluatedProperties", "unevaluatedItems", "then", "else")
# llguidance writes a number with a decimal multipleOf as at most this many fraction digits
# (``multipleOf: 1e-10``; a smaller step is "too many digits" for it), and an integer range
# as 64-bit integers
MAX_LLGUIDANCE_FRAC_DIGITS = 10
MAX_LLGUIDANCE_INT_DIGITS = 18


def number_guards(node, int_digits: int, frac_digits: int,
                  budget: RewriteBudget | None = None):
    """``node`` with xgrammar's runaway guards written into its ``number`` / ``integer``
    nodes as keywords llguidance turns into bounded digit runs (it has no digit bounds of
    its own), where the node sets no bound of its own:

    - an integer gets ``minimum`` / ``maximum`` of ``±(10**int_digits - 1)``: at most
      ``int_digits`` digits, exactly;
    - a number gets ``exclusiveMinimum`` / ``exclusiveMaximum`` of ``±10**int_digits``
      (at most ``int_digits`` integer digits) and ``multipleOf: 10**-frac_digits`` (at most
      ``frac_digits`` fraction digits).

    A side the schema bounds (``minimum`` / ``maximum``, either exclusive form) is left as
    written, and a guard never cuts off the values the schema demands: opposite a bound
    beyond it, the guard widens to that bound's digit count (``minimum: 1e16`` with 15
    integer digits gets ``exclusiveMaximum: 1e17``). A node with its own ``multipleOf``
    keeps it (it fixes the fraction digits itself). An integer bound past 64 bits is a
    ValueError (llguidance would clamp it). llguidance writes a bounded number
    without an exponent, so under the guards no exponent is written at all (xgrammar
    allows ``max_exp_digits`` of them).

    Values of any type get the guards too (``_guard_untyped``): a node without ``type``
    (``{}``, ``true``, one with only annotations or string / object keywords) gets the
    number's bounds (JSON Schema applies them to numbers only), and an object or array
    node that leaves its other properties / items open gets them as a guarded any-value
    (a definition ``#/$defs/<_ANY_VALUE>`` added to the root).

    Guards narrow what the grammar allows; the post-validation still checks the schema as
    the client wrote it. 0 turns a guard off. Runs under ``budget`` as ``exact_rewrites``
    does."""
    if not int_digits and not frac_digits:
        return node
    return under_budget(budget, _guarded_root, node, int_digits, frac_digits)


def any_value_guarded(int_digits: int, frac_digits: int) -> dict:
    """A schema for any JSON value whose numbers (at any depth) carry the guards
    (``number_guards``): what a JSON object's values are under ``json_object``."""
    ref = {"$ref": f"#/$defs/{_ANY_VALUE}"}
    return {"$defs": {_ANY_VALUE: _any_value(ref, int_digits, frac_digits)}, "type": "object",
            "additionalProperties": ref}


_ANY_VALUE = "rayguide_any_value"
# keywords whose meaning depends on which properties / items a node's own keywords
# evaluate, or on a base other than the root: an added ``items`` / ``additionalProperties``
# or a ``$ref`` to the root's definitions could change it (only the numbers' own bounds
# are added where the schema has any of them)
_CONTEXT_WORDS = ('"unevaluatedProperties"', '"unevaluatedItems"', '"$id"', '"id"',
                  '"$anchor"', '"$dynamicRef"', '"$dynamicAnchor"', '"$recursiveRef"',
                  '"$recursiveAnchor"')
# subschemas that apply to the same value as the node around them: llguidance intersects
# them with it (an added any-value there would narrow the properties the node declares,
# and intersecting recursive definitions exceeds its stack): they get the number's own
# bounds only (the branches of an anyOf / oneOf that stands alone are not intersected)
_MERGED = frozenset(("allOf", "anyOf", "oneOf", "then", "else", "dependentSchemas"))
# keywords beside which a node's values are also constrained elsewhere (its branches, a
# reference's target: guarded there)
_COMBINED = ("allOf", "anyOf", "oneOf", "$ref", "enum", "const", "not", "if")


def _any_value(ref: dict, int_digits: int, frac_digits: int) -> dict:
    number = _guarded({"type": "number"}, int_digits, frac_digits, None)
    return {"anyOf": [{"type": ["null", "boolean", "string"]}, number,
                      {"type": "array", "items": ref},
                      {"type": "object", "additionalProperties": ref}]}


def _guarded_root(node, int_digits: int, frac_digits: int):
    any_ref = None
    if isinstance(node, dict) and not any(w in json.dumps(node) for w in _CONTEXT_WORDS):
        defs = node.get("$defs")
        if defs is None or isinstance(defs, dict) and _ANY_VALUE not in defs:
            any_ref = {"$ref": f"#/$defs/{_ANY_VALUE}"}
    out = _guarded(node, int_digits, frac_digits, any_ref)
    if any_ref is not None and _ANY_VALUE in json.dumps(out):
        out = {**out, "$defs": {**out.get("$defs", {}),
                                _ANY_VALUE: _any_value(any_ref, int_digits, frac_digits)}}
    return out


def _guarded(node, int_digits: int, frac_digits: int, any_ref: dict | None):
    if isinstance(node, list):
        return [_guarded(sub, int_digits, frac_digits, any_ref) for sub in node]
    if node is True and any_ref is not None:
        return dict(any_ref)
    if not isinstance(node, dict):
        return node
    spend()
    out = dict(node)
    for key in _GUARDED_MAPS:
        if isinstance(node.get(key), dict):
            ref = None if key in _MERGED else any_ref
            out[key] = {name: _guarded(sub, int_digits, frac_digits, ref)
                        for name, sub in node[key].items()}
    for key in (*_GUARDED_VALUES, *_SAME_LISTS):
        if isinstance(node.get(key), (dict, list)) or node.get(key) is True:
            alone = key in ("anyOf", "oneOf") and set(node) - ANNOTATIONS == {key}
            ref = None if key in _MERGED and not alone else any_ref
            out[key] = _guarded(node[key], int_digits, frac_digits, ref)
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(
        types, list) else set()
    if "number" in types:
        _bound_range(out, int_digits, exclusive=True)
        if frac_digits and "multipleOf" not in out:
            out["multipleOf"] = float(f"1e-{frac_digits}")
    elif "integer" in types:
        _bound_range(out, int_digits, exclusive=False)
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = _number(out.get(key))
            if value is not None and abs(value) >= 2 ** 63:
                # llguidance clamps such a bound to 64 bits and then allows values the
                # schema forbids (minimum 1e20 took 9223372036854775807): refused instead
                raise ValueError(f"the integer bound {key}: {out[key]} is past "
                                 "llguidance's 64-bit integer ranges")
    if not any(k in node for k in _COMBINED):
        out = _guard_untyped(out, types, int_digits, frac_digits, any_ref)
    return out


def _guard_untyped(out: dict, types: set, int_digits: int, frac_digits: int,
                   any_ref: dict | None) -> dict:
    """``out`` (a node with no combinator beside it) with the guards on the values it
    leaves untyped: its own value when it has no ``type``, the other properties of an
    object and the further items of an array it leaves open (see number_guards)."""
    if not types and any_ref is not None and not set(out) - ANNOTATIONS:
        return {**out, **any_ref}  # any value at all: the guarded one
    if not types:
        _bound_range(out, int_digits, exclusive=True)
        if frac_digits and "multipleOf" not in out:
            out["multipleOf"] = float(f"1e-{frac_digits}")
    if any_ref is None:
        return out
    if (not types or "object" in types) and out.get("additionalProperties", True) is True:
        out["additionalProperties"] = dict(any_ref)
    if not types or "array" in types:
        if isinstance(out.get("items"), list):
            if out.get("additionalItems", True) is True:
                out["additionalItems"] = dict(any_ref)
        elif out.get("items", True) is True:
            out["items"] = dict(any_ref)
    return out


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(
        value, bool) else None


def _bound_range(out: dict, digits: int, exclusive: bool) -> None:
    """Adds the integer-digit guard to the sides of ``out`` that have no bound."""
    if not digits:
        return
    low = [v for v in (_number(out.get("minimum")), _number(out.get("exclusiveMinimum")))
           if v is not None]
    high = [v for v in (_number(out.get("maximum")), _number(out.get("exclusiveMaximum")))
            if v is not None]
    if not high:  # (digits of the far bound on the other side: the guard must not cut it)
        width = max([digits] + [_int_digits(v) for v in low if v > 0])
        if exclusive:
            out["exclusiveMaximum"] = 10 ** width
        else:
            out["maximum"] = 10 ** width - 1
    if not low:
        width = max([digits] + [_int_digits(v) for v in high if v < 0])
        if exclusive:
            out["exclusiveMinimum"] = -10 ** width
        else:
            out["minimum"] = -(10 ** width - 1)


def _int_digits(value: float) -> int:
    """The digits of ``value`` 's integer part (at least 1)."""
    return len(str(int(abs(value)))) if abs(value) < 1e300 else 301
