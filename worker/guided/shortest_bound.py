"""A lower bound, in tokens, on the shortest output of a JSON-schema grammar.

The admission check (output_policy.py) refuses a budget that the grammar's shortest output
cannot fit. Its search (closing.py) is capped in time and, for a schema whose shortest
output is long (``minItems: 40`` objects), gives up without a verdict. This bound decides
those in microseconds, from the schema's structure alone:

    counts = schema_counts(schema)       # per grammar: what every output must contain
    need   = capacity.min_tokens(counts)  # per vocabulary: the fewest tokens that hold it

``counts`` is a vector: the output's bytes, and how many times each of ``{ } [ ] " : ,``
occurs in it, each a lower bound over every output the grammar accepts (the required
properties with their keys, colons and commas; ``minItems`` times the shortest item; a
string's quotes and its ``minLength``, fixed format or pattern width; a const's literal).
Where a node may be read more than one way (``anyOf``, a ``$ref`` or ``const`` beside
other keywords, xgrammar taking ``allOf`` as ``anyOf``), the componentwise minimum over
the readings is kept, so the bound holds whichever reading xgrammar 0.2.8 makes.

Why it is a lower bound in tokens: for any set S of those characters, a token's text holds
at most ``cap(S)`` of them (the vocabulary's maximum, measured once), so an output holding
``W(S)`` of them needs at least ``ceil(W(S) / cap(S))`` tokens, whatever the tokenization.
The bound is the largest of these over a few sets (bytes alone are weak: one token holds
81 blanks; quotes are strong: no token holds more than 3). Blanks, numbers' digits and a
string's free text count for nothing, so a schema of short required strings in a short
object gets a loose bound, and the search decides it.

A second bound counts tokens directly: the texts every output spells literally, a required
property's name with its quotes and the shortest of an enum's strings (both grammar
backends write them as their compact JSON text; tests/engine/test_budget_bound_engine.py
checks that they refuse an escaped spelling). These texts lie apart in the output, so the
tokens that *start* inside each are distinct tokens, and each text needs at least
``TokenCapacity.cover(text)`` of them: the fewest in any tiling of the text by vocabulary
tokens where the first may begin before the text (a token ending in its first bytes) and
the last may run past it. With ``schema_counts(schema, cover=capacity.cover)`` their sum
is ``Counts[9]``, and ``capacity.bound(schema)`` takes the larger of the two bounds. A
schema of 88 required camelCase names (Github_ultra/o21136): 224 tokens from the
characters, 984 from the names, where a real output needs over 512.
"""

from __future__ import annotations

import json
from typing import Callable, Iterable

import numpy as np

from core.json_schema import Resolver

# the counted characters; Counts[0] is the output's length in bytes, Counts[1 + i] the
# occurrences of _CHARS[i], Counts[8] its digits, Counts[9] the tokens its literal texts
# need (0 without a cover: see the module doc)
_CHARS = b'{}[]":,'
Counts = tuple[int, ...]
_BRACE_O, _BRACE_C, _BRACK_O, _BRACK_C, _QUOTE, _COLON, _COMMA = range(1, 8)
_DIGITS = 8
_FIXED = 9
_ZERO: Counts = (0,) * 10
Cover = Callable[[str], int]
# weight sets (indices into Counts): bytes, each counted kind, and a few unions (a token
# holds at most 3 of '{}"' where it holds 16 commas; many vocabularies spell numbers one
# digit a token)
_PUNCT = ((_BRACE_O, _BRACE_C, _QUOTE), (_BRACE_O, _BRACE_C, _BRACK_O, _BRACK_C, _QUOTE),
          (_BRACE_O, _BRACE_C, _BRACK_O, _BRACK_C, _QUOTE, _COLON))
_SETS = tuple((i,) for i in range(9)) + _PUNCT + tuple(s + (_DIGITS,) for s in _PUNCT)


def _vec(nbytes: int = 0, index: int | None = None, n: int = 0, digits: int = 0) -> Counts:
    """``nbytes`` bytes, of which ``n`` are the counted character ``index`` (its bytes
    are included) and ``digits`` are digits (included in ``nbytes`` by the caller)."""
    c = [nbytes, 0, 0, 0, 0, 0, 0, 0, digits, 0]
    if index is not None:
        c[0] += n
        c[index] += n
    return tuple(c)


ANY: Counts = _vec(1)  # some JSON value: one byte at least ("0")
_WORD: Counts = _vec(4)  # "true", "null"
_NUMBER: Counts = _vec(1, digits=1)  # JSON spells every number with a digit
_MAX_DEPTH = 64
_MAX_NODES = 20_000  # schema nodes visited per bound; past it every node counts as ANY
# (characters, digits) of the shortest text of each string format xgrammar 0.2.8
# enforces, read off its grammar: uuid 8-4-4-4-12 hex digits (perhaps all letters),
# YYYY-MM-DD, YYYY-MM-DDTHH:MM:SSZ, HH:MM:SSZ, a@b, 0.0.0.0; an unknown format is not
# enforced
_FORMATS = {"uuid": (36, 0), "date": (10, 8), "date-time": (20, 14), "time": (9, 6),
            "email": (3, 0), "ipv4": (7, 4)}


def _add(*parts: Counts) -> Counts:
    return tuple(map(sum, zip(*parts)))


def _times(c: Counts, n: int) -> Counts:
    return tuple(x * n for x in c)


def _least(options: Iterable[Counts]) -> Counts:
    """Componentwise minimum: a bound for an output that is one of the options."""
    return tuple(map(min, zip(*options)))


def _char(index: int, n: int = 1) -> Counts:
    return _vec(index=index, n=n)


def _text(text: str, cover: Cover | None = None) -> Counts:
    """A JSON string of fixed text (a key, a const): its quotes, one byte at least per
    character and its digits (an escape is longer, and ``\\u0031`` still holds digits).
    Its other counted characters are not counted: an escape may spell them otherwise.
    With a ``cover``, the tokens its JSON text needs, where that text has one spelling
    only (printable ASCII without a quote or a backslash: nothing to escape)."""
    digits = sum(ch.isascii() and ch.isdigit() for ch in text)
    counts = _add(_char(_QUOTE, 2), _vec(len(text), digits=digits))
    if cover is not None and text.isascii() and text.isprintable() and not (
            set(text) & {'"', "\\"}):
        counts = counts[:_FIXED] + (cover(f'"{text}"'),)
    return counts


def schema_counts(schema, cover: Cover | None = None) -> Counts:
    """What every output of the grammar for ``schema`` (a dict, bool or JSON text)
    contains at least: bytes, then ``{ } [ ] " : ,``, digits, and with a ``cover``
    (``TokenCapacity.cover``) the tokens of its literal texts (see the module doc). A
    schema that cannot be read gives ``ANY``."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            return ANY
    return _Walk(schema, cover).value(schema, 0)


class _Walk:
    def __init__(self, root, cover: Cover | None = None):
        self.cover = cover
        self.resolver = Resolver(root)
        self.nodes = 0
        self.refs: dict[str, Counts] = {}  # resolved $refs (a cycle cut at ANY: lower still)
        self.open_refs: set[str] = set()

    def value(self, node, depth: int) -> Counts:
        self.nodes += 1
        if not isinstance(node, dict) or depth > _MAX_DEPTH or self.nodes > _MAX_NODES:
            return ANY  # true, false (no output compiles), or too deep to look at
        readings = []
        ref = node.get("$ref")
        if isinstance(ref, str):
            readings.append(self._ref(ref, depth))
        for key in ("anyOf", "oneOf", "allOf"):  # xgrammar takes all three as anyOf
            branches = node.get(key)
            if isinstance(branches, list) and branches:
                readings.append(_least(self.value(b, depth + 1) for b in branches))
        if "const" in node:
            readings.append(literal(node["const"], depth, self.cover))
        enum = node.get("enum")
        if isinstance(enum, list) and enum:
            readings.append(_least(literal(v, depth, self.cover) for v in enum))
        typed = self._typed(node, depth)
        if typed is not None:
            readings.append(typed)
        # xgrammar reads one of these (a const or $ref over the type beside it, anyOf
        # over the properties beside it) or all at once: the least holds either way
        return _least(readings) if readings else ANY

    def _typed(self, node: dict, depth: int) -> Counts | None:
        kind = node.get("type")
        if kind is None and isinstance(node.get("properties"), dict):
            # xgrammar reads an object; llguidance, as JSON Schema says, any value (the
            # properties bind objects only: ``0`` is an instance): the least of both
            return _least((self._object(node, depth), ANY))
        kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else None
        if not kinds:
            return None
        return _least(self._of_type(node, k, depth) for k in kinds)

    def _of_type(self, node: dict, kind, depth: int) -> Counts:
        if kind == "object":
            return self._object(node, depth)
        if kind == "array":
            return self._array(node, depth)
        if kind == "string":
            return _add(_char(_QUOTE, 2), _string_content(node))
        if kind in ("integer", "number"):
            return _NUMBER
        if kind in ("boolean", "null"):
            return _WORD  # "true", "null": 4 bytes
        return ANY

    def _object(self, node: dict, depth: int) -> Counts:
        props = node.get("properties")
        required = node.get("required")
        parts = [_char(_BRACE_O), _char(_BRACE_C)]
        if isinstance(props, dict) and isinstance(required, list):
            # a required name without a property schema is left out (what xgrammar makes
            # of it is not counted on)
            names = [n for n in dict.fromkeys(r for r in required if isinstance(r, str))
                     if n in props]
            for name in names:
                parts += [_text(name, self.cover), _char(_COLON),
                          self.value(props[name], depth + 1)]
            if names:
                parts.append(_char(_COMMA, len(names) - 1))
        return _add(*parts)

    def _array(self, node: dict, depth: int) -> Counts:
        n = node.get("minItems", 0)
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            return _add(_char(_BRACK_O), _char(_BRACK_C))
        prefix = node.get("prefixItems")
        prefix = prefix[:n] if isinstance(prefix, list) else []
        items = node.get("items")
        rest = self.value(items, depth + 1) if isinstance(items, dict) else ANY
        parts = [_char(_BRACK_O), _char(_BRACK_C), _char(_COMMA, n - 1),
                 _times(rest, n - len(prefix))]
        parts += [self.value(p, depth + 1) for p in prefix]
        return _add(*parts)

    def _ref(self, ref: str, depth: int) -> Counts:
        if ref in self.refs:
            return self.refs[ref]
        if ref in self.open_refs:
            return ANY  # recursion: the least a value can be
        target = self.resolver.get(ref)
        if target is None:
            return ANY
        self.open_refs.add(ref)
        found = self.value(target, depth + 1)
        self.open_refs.discard(ref)
        self.refs[ref] = found
        return found


def _string_content(node: dict) -> Counts:
    """What a string's content holds at least. xgrammar 0.2.8 enforces a format over a
    pattern over minLength (one of them, not their intersection), so the least of those
    present is kept."""
    bounds = []
    if isinstance(node.get("format"), str):
        chars, digits = _FORMATS.get(node["format"], (0, 0))
        bounds.append(_vec(chars, digits=digits))
    if isinstance(node.get("pattern"), str):
        bounds.append(_vec(_pattern_width(node["pattern"])))
    n = node.get("minLength")
    if isinstance(n, int) and not isinstance(n, bool):
        bounds.append(_vec(max(n, 0)))
    return _least(bounds) if bounds else _ZERO


def _pattern_width(pattern: str) -> int:
    """The fewest characters the regex matches, from Python's own regex parser (an
    ECMAScript pattern it cannot parse, or parses differently, counts 0: a narrower
    reading only ever lowers the width)."""
    try:
        from re import _parser
        low = _parser.parse(pattern).getwidth()[0]
    except Exception:  # any pattern Python's parser refuses: no bound from it
        return 0
    return min(int(low), 1 << 20)


def literal(value, depth: int = 0, cover: Cover | None = None) -> Counts:
    """What the JSON text of a const value contains at least (compact: no blanks; a
    number counts one byte, xgrammar may write ``1.0`` as ``1``)."""
    if depth > _MAX_DEPTH:
        return ANY
    if value is None or value is True:
        return _WORD
    if value is False:
        return _vec(5)
    if isinstance(value, str):
        return _text(value, cover)
    if isinstance(value, list):
        parts = [_char(_BRACK_O), _char(_BRACK_C), _char(_COMMA, max(len(value) - 1, 0))]
        return _add(*parts, *(literal(v, depth + 1, cover) for v in value))
    if isinstance(value, dict):
        parts = [_char(_BRACE_O), _char(_BRACE_C), _char(_COMMA, max(len(value) - 1, 0))]
        for k, v in value.items():
            parts += [_text(str(k), cover), _char(_COLON), literal(v, depth + 1, cover)]
        return _add(*parts)
    return _NUMBER


class TokenCapacity:
    """How many of each counted character one token of a vocabulary holds at most."""

    def __init__(self, vocab: list[bytes]):
        """``vocab``: each token id's text as bytes (xgrammar's ``decoded_vocab``)."""
        lengths = np.fromiter((len(t) for t in vocab), dtype=np.int64, count=len(vocab))
        text = np.frombuffer(b"".join(vocab), dtype=np.uint8)
        owner = np.repeat(np.arange(len(vocab)), lengths)  # [total bytes]: its token id
        # per_token[k]: [vocab] counts of Counts[k] in each token's text
        per_token = [lengths] + [np.bincount(owner[text == c], minlength=len(vocab))
                                 for c in _CHARS]
        per_token.append(np.bincount(owner[(text >= 0x30) & (text <= 0x39)],
                                     minlength=len(vocab)))
        self.caps = [int(sum(per_token[i] for i in s).max(initial=0)) for s in _SETS]
        self._vocab = vocab
        self._tokens: set[bytes] | None = None  # (built on the first cover)
        self._covers: dict[str, int] = {}

    def bound(self, schema) -> int:
        """The fewest tokens of any output of ``schema``'s grammar: both bounds."""
        return self.min_tokens(schema_counts(schema, cover=self.cover))

    def cover(self, text: str) -> int:
        """The fewest tokens that start inside ``text`` wherever an output spells it (see
        the module doc): 0 where one token can hold it whole."""
        known = self._covers.get(text)
        if known is not None:
            return known
        self.prepare()
        raw = text.encode()
        n = len(raw)
        if len(self._covers) > _COVERS_KEPT:
            self._covers.clear()
        if raw in self._blob:
            self._covers[text] = 0  # one token holds it (and whatever lies either side)
            return 0
        # fewest[i]: tokens starting at i, i+1, ... that tile raw[i:] (the last may run on)
        fewest = [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            best = 1 if raw[i:] in self._prefixes else _NEVER
            for j in range(i + 1, min(n, i + self._longest) + 1):
                if fewest[j] + 1 < best and raw[i:j] in self._tokens:
                    best = fewest[j] + 1
            fewest[i] = best
        # the first token starting inside may begin at k: raw[:k] ends a token before it
        need = min(fewest[k] for k in range(n) if k == 0 or raw[:k] in self._suffixes)
        self._covers[text] = need
        return need

    def prepare(self) -> None:
        """Builds the tables ``cover`` reads (a third of a second for a 49,152-token
        vocabulary: GuidedPath.prepare runs it beside the engine at its start, so no
        request's admission pays it). Published whole, ``_tokens`` last: a cover on
        another thread meanwhile builds its own."""
        if self._tokens is not None:
            return
        tokens = {t for t in self._vocab if t}
        self._prefixes = {t[:i] for t in tokens for i in range(1, len(t) + 1)}
        self._suffixes = {t[-i:] for t in tokens for i in range(1, len(t) + 1)}
        self._blob = b"\x00".join(tokens)
        self._longest = max(map(len, tokens), default=1)
        self._tokens = tokens

    def min_tokens(self, counts: Counts) -> int:
        """The fewest tokens whose texts can hold ``counts``: for every weight set with a
        cap, ceil(weight / cap) (see the module doc)."""
        need = counts[_FIXED]  # (0 where the counts were taken without a cover)
        for s, cap in zip(_SETS, self.caps):
            if cap:
                need = max(need, -(-sum(counts[i] for i in s) // cap))
        return need


_NEVER = 1 << 30
_COVERS_KEPT = 65_536  # texts whose cover a TokenCapacity keeps
