"""A short valid output of a JSON schema, built from the schema itself (a witness).

The closing search finds the shortest output of a grammar from the matcher alone, which
holds for every grammar kind but not for every size: in a large object whose required keys
come after many optional ones, its dive takes each optional key as it comes, and its exact
search runs out of nodes (Github_hard/o60179: the dive's output from the start is 129
tokens; one of about 40 exists, with the 4 required keys only). A JSON schema says which
keys may be left out, so a short instance can be written from it directly:

    value = witness(schema)          # a Python value, or None where no rule below fits
    path = witness_tokens(schema, matcher, encode, vocab_size)   # or None

``witness`` takes, node by node: ``const``; the shortest ``enum`` value; the shortest
branch of ``anyOf`` / ``oneOf`` (each merged with the keywords beside it), ``allOf``
merged into one node; ``$ref`` resolved (core/json_schema.py's resolver; a cycle gives
up); an object with its required keys in ``properties`` order (then those named by
``required`` alone), and optional ones only up to ``minProperties``; an array of
``minItems`` copies of the shortest item (``prefixItems`` first); a string of
``minLength`` letters or a fixed example of its ``format`` (with a ``pattern``, where that
text does not match it, the pattern's own shortest text: each repeat at its minimum, the
shortest branch, a class's first safe character); the number nearest 0 within its bounds and ``multipleOf``; ``true``;
``null``. Whatever it cannot satisfy by these rules (``uniqueItems`` over copies, a
pattern the example misses) is caught after: the value is kept only when the schema
validates it (validation.py, the same check answers get).

``witness_tokens`` then writes the value with each of JSON's usual layouts (``", "`` and
``": "``, then compact), tokenizes it with the model's tokenizer and replays it on a fork
of ``matcher`` (a fresh matcher of the grammar): kept only where the grammar accepts every
token and may end after the last. So a witness is a real output of the grammar, valid for
the schema; it is never taken to say that no shorter one exists. Callers
(output_policy.py's admission, grammar_check.py) use it beside the search: the shorter
wins.

Bounded: at most ``_MAX_NODES`` schema nodes visited, ``_MAX_DEPTH`` deep, and a value of
at most ``_MAX_TEXT`` characters, so a hostile schema costs milliseconds.
"""

from __future__ import annotations

import json
import math
import re
import warnings

try:  # the regex parser of the standard library (re._parser from 3.11)
    from re import _constants as sre_constants, _parser as sre_parse
except ImportError:  # pragma: no cover
    import sre_constants
    import sre_parse
from typing import Callable

from core.json_schema import Resolver
from worker.guided.validation import validate_json

_MAX_NODES = 5000
_MAX_DEPTH = 32
_MAX_TEXT = 16384  # a witness's text, at most: replayed in ~30 ms (a 5.4 KB one, ~1,450
# tokens, in 9 ms on llguidance); JSONSchemaBench's Github_ultra/o21136 needs 5.4 KB
_FORMATS = {  # a short instance of each format the grammars enforce
    "date-time": "2000-01-01T00:00:00Z", "date": "2000-01-01", "time": "00:00:00Z",
    "duration": "P1D", "email": "a@b.co", "idn-email": "a@b.co", "hostname": "a.co",
    "idn-hostname": "a.co", "ipv4": "0.0.0.0", "ipv6": "::1", "uri": "http://a.co",
    "iri": "http://a.co", "uri-reference": "a", "iri-reference": "a",
    "uuid": "00000000-0000-0000-0000-000000000000", "uri-template": "a",
    "json-pointer": "", "relative-json-pointer": "0", "regex": "a",
}
_COMBINED = ("anyOf", "oneOf")


class _NoWitness(Exception):
    """No rule here gives a value for this node."""


def witness(schema):
    """A short instance of ``schema`` (a dict or bool) by the rules in the module doc, or
    None where they give none. Not checked against the schema: ``witness_tokens`` is."""
    try:
        return _Builder(schema).value(schema, 0)
    except (_NoWitness, RecursionError, TypeError, ValueError, OverflowError):
        return None


def witness_tokens(schema, matcher, encode: Callable[[str], list[int]]) -> list[int] | None:
    """The witness as tokens the grammar accepts from ``matcher``'s state (a fresh
    matcher: the grammar's start) and may end after, valid for ``schema``; None when there
    is no witness, or the grammar or the schema refuses it in every layout."""
    value = witness(schema)
    if value is None and not _null_ok(schema):
        return None
    for layout in ((", ", ": "), (",", ":")):
        text = json.dumps(value, ensure_ascii=False, separators=layout)
        if len(text) > _MAX_TEXT:
            return None
        if validate_json(schema, text) is not None:
            return None  # the rules missed a keyword: the layout does not matter
        tokens = encode(text)
        probe = matcher.fork()
        if probe.accept_tokens(tokens) and probe.is_completed():
            return tokens
    return None


def _null_ok(schema) -> bool:
    return schema is True or (isinstance(schema, dict) and (
        schema.get("type") == "null" or schema.get("const", 0) is None))


class _Builder:
    def __init__(self, root):
        self.resolver = Resolver(root) if isinstance(root, dict) else None
        self.nodes = 0
        self.open_refs: set[str] = set()

    def value(self, node, depth: int):
        self.nodes += 1
        if self.nodes > _MAX_NODES or depth > _MAX_DEPTH:
            raise _NoWitness
        if node is True:
            return None
        if not isinstance(node, dict):
            raise _NoWitness  # false: no instance
        ref = node.get("$ref")
        if isinstance(ref, str):
            return self._ref(node, ref, depth)
        if "allOf" in node:
            return self.value(self._merged(node), depth + 1)
        for key in _COMBINED:
            branches = node.get(key)
            if isinstance(branches, list) and branches:
                rest = {k: v for k, v in node.items() if k != key}
                found = []
                for b in branches:
                    b = self._deref(b)
                    if not isinstance(b, dict):
                        continue
                    try:
                        found.append(self.value({**rest, **b}, depth + 1))
                    except _NoWitness:
                        pass
                if not found:
                    raise _NoWitness
                return min(found, key=_size)
        if "const" in node:
            return node["const"]
        enum = node.get("enum")
        if isinstance(enum, list) and enum:
            return min(enum, key=_size)
        kinds = node.get("type")
        if isinstance(kinds, str):
            kinds = [kinds]
        if not isinstance(kinds, list) or not kinds:
            kinds = [_implied_type(node)]
        found = []
        for kind in kinds:
            try:
                found.append(self._of_type(node, kind, depth))
            except _NoWitness:
                pass
        if not found:
            raise _NoWitness
        return min(found, key=_size)

    def _deref(self, node):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if isinstance(ref, str) and len(node) == 1 and self.resolver is not None:
            target = self.resolver.get(ref)
            return target if target is not None else node
        return node

    def _ref(self, node: dict, ref: str, depth: int):
        if ref in self.open_refs or self.resolver is None:
            raise _NoWitness  # a cycle: its shortest way out is not looked for here
        target = self.resolver.get(ref)
        if target is None:
            raise _NoWitness
        rest = {k: v for k, v in node.items() if k != "$ref"}
        self.open_refs.add(ref)
        try:
            if rest and isinstance(target, dict):
                return self.value({**target, **rest}, depth + 1)
            return self.value(target, depth + 1)
        finally:
            self.open_refs.discard(ref)

    def _merged(self, node: dict) -> dict:
        """``allOf`` folded into one node: keywords of the later parts over the earlier,
        properties joined, ``required`` united (the validation after catches a
        conflict)."""
        out = {k: v for k, v in node.items() if k != "allOf"}
        parts = node.get("allOf")
        if not isinstance(parts, list):
            raise _NoWitness
        for part in parts:
            part = self._deref(part)
            if not isinstance(part, dict) or "$ref" in part:
                raise _NoWitness
            for k, v in part.items():
                if k == "properties" and isinstance(v, dict):
                    out["properties"] = {**out.get("properties", {}), **v}
                elif k == "required" and isinstance(v, list):
                    out["required"] = list(dict.fromkeys(out.get("required", []) + v))
                else:
                    out[k] = v
        return out

    def _of_type(self, node: dict, kind, depth: int):
        if kind == "object":
            return self._object(node, depth)
        if kind == "array":
            return self._array(node, depth)
        if kind == "string":
            return _string(node)
        if kind in ("integer", "number"):
            return _number(node, kind == "integer")
        if kind == "boolean":
            return True
        if kind == "null":
            return None
        raise _NoWitness

    def _object(self, node: dict, depth: int) -> dict:
        props = node.get("properties")
        props = props if isinstance(props, dict) else {}
        required = node.get("required")
        required = [r for r in required if isinstance(r, str)] if isinstance(
            required, list) else []
        want = set(required)
        names = [n for n in props if n in want] + [n for n in dict.fromkeys(required)
                                                   if n not in props]
        least = node.get("minProperties", 0)
        if isinstance(least, int) and len(names) < least:
            names += [n for n in props if n not in want][:least - len(names)]
            if len(names) < least:
                raise _NoWitness
        out = {}
        for name in names:
            sub = props.get(name, node.get("additionalProperties", True))
            if sub is False:
                raise _NoWitness
            out[name] = self.value(True if sub is None else sub, depth + 1)
        return out

    def _array(self, node: dict, depth: int) -> list:
        n = node.get("minItems", 0)
        n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0
        prefix = node.get("prefixItems")
        items = node.get("items")
        if isinstance(items, list):  # draft 4's tuple
            prefix, items = items, node.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        out = [self.value(p, depth + 1) for p in prefix[:n]]
        if len(out) < n:
            one = self.value(True if items is None else items, depth + 1)
            out += [one] * (n - len(out))
        return out


def _implied_type(node: dict) -> str:
    if any(k in node for k in ("properties", "required", "additionalProperties",
                               "minProperties", "patternProperties")):
        return "object"
    if any(k in node for k in ("items", "prefixItems", "minItems")):
        return "array"
    if any(k in node for k in ("minLength", "pattern", "format", "maxLength")):
        return "string"
    if any(k in node for k in ("minimum", "maximum", "exclusiveMinimum", "multipleOf")):
        return "number"
    return "integer"  # any value: ``0`` is the shortest


def _string(node: dict) -> str:
    fmt = node.get("format")
    n = node.get("minLength", 0)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0
    text = _FORMATS.get(fmt, "a" * n) if isinstance(fmt, str) else "a" * n
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        if not _matches(pattern, text):
            text = _shortest_match(pattern)  # the pattern's own shortest text
            if text is None or len(text) < n or not _matches(pattern, text):
                raise _NoWitness
    return text


def _matches(pattern: str, text: str) -> bool:
    try:
        with warnings.catch_warnings():  # (a FutureWarning on some character classes)
            warnings.simplefilter("ignore")
            return re.search(pattern, text) is not None
    except (re.error, RecursionError):
        return False


_SAFE = "a0A-_.~ "  # characters tried where a class allows many (never a quote or escape)


def _shortest_match(pattern: str) -> str | None:
    """A shortest text Python's regex engine matches in full for ``pattern`` (None where it
    holds what this does not write: back-references, lookarounds): each repeat at its
    minimum, the shortest branch, a class's first safe character. The caller checks it
    with ``re.search`` (and the grammar replays it)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parsed = sre_parse.parse(pattern)
        return _seq(list(parsed), 0)
    except (re.error, RecursionError, _NoWitness, ValueError, TypeError, OverflowError):
        return None


def _seq(items, depth: int) -> str:
    if depth > _MAX_DEPTH:
        raise _NoWitness
    return "".join(_item(op, av, depth) for op, av in items)


def _item(op, av, depth: int) -> str:
    c = sre_constants
    if op == c.LITERAL:
        return chr(av)
    if op == c.AT:
        return ""
    if op in (c.MAX_REPEAT, c.MIN_REPEAT) or op == getattr(c, "POSSESSIVE_REPEAT", None):
        least, _, body = av
        if least > 64:
            raise _NoWitness
        return _seq(list(body), depth + 1) * least
    if op == c.SUBPATTERN:
        return _seq(list(av[-1]), depth + 1)
    if op == getattr(c, "ATOMIC_GROUP", None):
        return _seq(list(av), depth + 1)
    if op == c.BRANCH:
        return min((_seq(list(b), depth + 1) for b in av[1]), key=len)
    if op in (c.IN, c.ANY, c.NOT_LITERAL, c.CATEGORY):
        for ch in _SAFE + "".join(_members(op, av)):
            if _in_class(op, av, ch):
                return ch
        raise _NoWitness
    raise _NoWitness  # back-references, lookarounds, conditionals


def _members(op, av) -> list[str]:
    """The characters a class names first (a literal, a range's first): where no safe
    character is in it (``[1-5]``), printable and neither a quote nor a backslash."""
    c = sre_constants
    if op == c.LITERAL or op != c.IN:
        return []
    out = []
    for kind, value in av:
        ch = chr(value) if kind == c.LITERAL else chr(value[0]) if kind == c.RANGE else ""
        if ch.isprintable() and ch not in "\"\\":
            out.append(ch)
    return out


def _in_class(op, av, ch: str) -> bool:
    c = sre_constants
    if op == c.ANY:
        return ch != "\n"
    if op == c.NOT_LITERAL:
        return ord(ch) != av
    if op == c.CATEGORY:
        return _category(av, ch)
    negate = bool(av) and av[0][0] == c.NEGATE
    hit = False
    for kind, value in (av[1:] if negate else av):
        if kind == c.LITERAL and ord(ch) == value or kind == c.RANGE and (
                value[0] <= ord(ch) <= value[1]) or kind == c.CATEGORY and _category(value, ch):
            hit = True
            break
    return hit != negate


def _category(cat, ch: str) -> bool:
    c = sre_constants
    return {c.CATEGORY_DIGIT: ch.isdigit(), c.CATEGORY_NOT_DIGIT: not ch.isdigit(),
            c.CATEGORY_WORD: ch.isalnum() or ch == "_",
            c.CATEGORY_NOT_WORD: not (ch.isalnum() or ch == "_"),
            c.CATEGORY_SPACE: ch.isspace(), c.CATEGORY_NOT_SPACE: not ch.isspace()}.get(
        cat, False)


def _number(node: dict, integer: bool):
    low, high = node.get("minimum"), node.get("maximum")
    xlow, xhigh = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
    step = node.get("multipleOf")
    candidates = [0]
    for bound in (low, xlow, high, xhigh):
        if isinstance(bound, (int, float)) and not isinstance(bound, bool):
            candidates += [math.ceil(bound), math.ceil(bound) + 1, math.floor(bound),
                           math.floor(bound) - 1]
    if isinstance(step, (int, float)) and not isinstance(step, bool) and step > 0:
        candidates = [c for c in {round(c / step) * step for c in candidates}
                      for _ in [0]] + [step]
    candidates = sorted(set(candidates), key=abs)
    for c in candidates:
        if integer and c != int(c):
            continue
        c = int(c) if c == int(c) else c
        if isinstance(low, (int, float)) and c < low or isinstance(high, (int, float)) and c > high:
            continue
        if xlow is True and c <= low or xhigh is True and c >= high:  # draft 4's booleans
            continue
        if (isinstance(xlow, (int, float)) and not isinstance(xlow, bool) and c <= xlow
                or isinstance(xhigh, (int, float)) and not isinstance(xhigh, bool)
                and c >= xhigh):
            continue
        return c
    raise _NoWitness


def _size(value) -> int:
    return len(json.dumps(value, ensure_ascii=False))
