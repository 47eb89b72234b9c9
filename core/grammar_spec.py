"""GrammarSpec: what a guided request asks for, in one canonical, hashable form.

Every way a client can ask for structure (deploy/dialects.py turns every API
dialect into one) becomes one ``GrammarSpec``. Its
``source`` is canonical text (JSON keeps the key order given, since property order is
part of what is generated), so equal requests give equal keys in every process:
``key(fingerprint)`` hashes a msgpack encoding of the spec plus the tokenizer's fingerprint.

Construction checks what is cheap to check (kind, types, sizes, JSON syntax) and raises
``ValueError`` naming the problem; grammar syntax is checked by the compiler.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, fields
from typing import Any

import msgpack

from core.errors import ErrorKind, GrammarError
from core.json_schema import is_local, nested_deeper, outside, pointer, walk

KINDS = ("json_schema", "json_object", "regex", "ebnf", "lark", "choice", "structural_tag")
ALIASES = {"regex_schema": "regex", "grammar": "ebnf", "gbnf": "ebnf", "json": "json_schema"}
WHITESPACE = ("bounded", "any", "compact", "indent", "spaced")
# the grammar engines a spec may ask for (worker/guided/backend.py); "auto": the
# server's default, and where that is "auto" too, the rule (llguidance for a JSON grammar
# it compiles, xgrammar elsewhere)
ENGINES = ("auto", "xgrammar", "llguidance")
MAX_SOURCE_BYTES = 256 * 1024
MAX_CHOICES = 4096
KEY_VERSION = 6  # 2: the engine is part of the key; 3: formats written as patterns;
# 4: no year 0000 in dates; 5: an e-mail's local part at most 64 characters, its domain a
# hostname; 6: for xgrammar a pattern beside a format, propertyNames, patternProperties
# (the disk tier needs no bump: its folder carries a digest of the code that writes
# grammars, grammar_cache/code_digest.py)


@dataclass(frozen=True)
class GrammarSpec:
    """kind: one of KINDS. source: canonical text (JSON for json_schema, choice and
    structural_tag; "" for json_object). JSON options (json_schema / json_object):
    whitespace "spaced" (default: json.dumps' layout on one line, ``{"a": 1, "b": [1, 2]}``,
    ", " and ": ", no other blanks; chosen by measurement, docs/benchmarks.md), "bounded"
    (any blanks, at most ``max_whitespace`` in a row), "any", "compact" (no whitespace:
    ``{"a":1}``) or "indent" (``indent`` spaces, json.dumps style); ``strict``: properties
    not in the schema are forbidden unless it allows them; ``any_order``: properties may
    come in any order (default: the schema's order).

    Runaway guards (JSON kinds and the JSON inside structural tags), on by default and
    part of the key: where the schema sets no bound, a number has at most
    ``max_int_digits`` integer digits (15: every such integer is exact in a JavaScript
    number), ``max_frac_digits`` fraction digits and ``max_exp_digits`` exponent digits;
    0 turns a guard off.

    ``engine``: the grammar engine asked for (one of ENGINES), part of the key: a grammar
    compiled by xgrammar and one by llguidance are different grammars."""

    kind: str
    source: str = ""
    whitespace: str = "spaced"
    max_whitespace: int = 12
    indent: int = 2
    strict: bool = True
    any_order: bool = False
    max_int_digits: int = 15
    max_frac_digits: int = 10
    max_exp_digits: int = 2
    engine: str = "auto"

    def __post_init__(self):
        kind = ALIASES.get(self.kind, self.kind)
        if kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; use one of {', '.join(KINDS)}")
        object.__setattr__(self, "kind", kind)
        if not isinstance(self.source, str):
            raise ValueError(f"{kind} grammar source must be a string")
        size = len(self.source.encode("utf-8", "surrogatepass"))
        if size > MAX_SOURCE_BYTES:
            raise GrammarError(f"{kind} grammar is {size} bytes, over the limit of "
                               f"{MAX_SOURCE_BYTES}; send a smaller grammar",
                               ErrorKind.GRAMMAR_TOO_LARGE)
        if kind != "json_object" and not self.source.strip():
            raise ValueError(f"{kind} grammar is empty")
        if self.engine not in ENGINES:
            raise ValueError(f"grammar engine {self.engine!r} is not one of "
                             f"{', '.join(ENGINES)}")
        if self.whitespace not in WHITESPACE:
            raise ValueError(f"whitespace {self.whitespace!r} is not one of {WHITESPACE}")
        if not 0 <= self.max_whitespace <= 256:
            raise ValueError(f"max_whitespace must be in [0, 256], got {self.max_whitespace}")
        if not 0 <= self.indent <= 16:
            raise ValueError(f"indent must be in [0, 16], got {self.indent}")
        for name in ("max_int_digits", "max_frac_digits", "max_exp_digits"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 1000:
                raise ValueError(f"{name} must be an integer in [0, 1000] (0: no bound), "
                                 f"got {value!r}")
        if kind in ("json_schema", "choice", "structural_tag"):
            value = _parse_json(kind, self.source)
            if kind == "json_schema" and not isinstance(value, (dict, bool)):
                raise ValueError("json_schema must be a JSON object (or true/false)")
            if kind == "json_schema":
                _check_refs(value)
            # (not a field: the key, equality and pickles stay those of the text)
            self.__dict__["_parsed"] = value
            if kind == "choice":
                _check_choices(value)
            if kind == "structural_tag" and not isinstance(value, dict):
                raise ValueError("structural_tag must be a JSON object")

    @property
    def parsed(self):
        """The source as parsed when the spec was built (json_schema, choice,
        structural_tag; None for the other kinds): what every later stage reads instead
        of parsing the text again. Shared: read it, never change it (the rewrites build
        new objects)."""
        if self.kind not in ("json_schema", "choice", "structural_tag"):
            return None
        value = self.__dict__.get("_parsed", _UNPARSED)
        if value is _UNPARSED:  # (a spec from a pickle: the text travelled, not the object)
            value = self.__dict__["_parsed"] = json.loads(self.source)
        return value

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_parsed"}

    # constructors -----------------------------------------------------------------------

    @classmethod
    def json_schema(cls, schema: dict | str | bool, **options) -> "GrammarSpec":
        """A JSON schema as a dict, a JSON string, or the OpenAI shape
        ``{"name": ..., "schema": {...}, "strict": bool}``."""
        if isinstance(schema, str):
            schema = _parse_json("json_schema", schema)
        # OpenAI's wrapper; ``name`` is required there but some clients omit it: a dict of
        # only wrapper keys around a schema is the wrapper (``schema`` is no JSON-schema
        # keyword), so the inner schema is what is enforced
        if isinstance(schema, dict) and isinstance(schema.get("schema"), (dict, bool)) and (
                "name" in schema or "strict" in schema or set(schema) <= _WRAPPER_KEYS):
            if "strict" in schema and schema["strict"] is not None:
                options.setdefault("strict", bool(schema["strict"]))
            schema = schema["schema"]
        return cls("json_schema", _canonical_json(schema), **options)

    @classmethod
    def json_object(cls, **options) -> "GrammarSpec":
        """Any JSON object."""
        options.setdefault("strict", False)
        return cls("json_object", "", **options)

    @classmethod
    def regex(cls, pattern: str, **options) -> "GrammarSpec":
        return cls("regex", pattern, **options)

    @classmethod
    def ebnf(cls, grammar: str, **options) -> "GrammarSpec":
        """An EBNF / GBNF grammar with a ``root`` rule (xgrammar's dialect)."""
        return cls("ebnf", grammar, **options)

    @classmethod
    def lark(cls, grammar: str, **options) -> "GrammarSpec":
        return cls("lark", grammar, **options)

    @classmethod
    def choice(cls, choices: list[str], **options) -> "GrammarSpec":
        """Exactly one of the given strings."""
        _check_choices(choices)
        return cls("choice", _canonical_json(list(choices)), **options)

    @classmethod
    def structural_tag(cls, tag: dict | str) -> "GrammarSpec":
        """xgrammar's structural tag: ``{"type": "structural_tag", "format": {...}}``, or
        the older ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``."""
        if isinstance(tag, str):
            return cls("structural_tag", tag)
        return cls("structural_tag", _canonical_json(tag))

    # identity ---------------------------------------------------------------------------

    def key(self, tokenizer_fingerprint: str = "") -> str:
        """Stable across processes: sha256 over a msgpack encoding of the spec plus the
        tokenizer's fingerprint. Computed once per fingerprint and kept on the spec."""
        memo = self.__dict__.setdefault("_keys", {})
        key = memo.get(tokenizer_fingerprint)
        if key is None:
            fields = self.to_dict()
            packed = msgpack.packb([KEY_VERSION, tokenizer_fingerprint] +
                                   [fields[k] for k in sorted(fields)])
            key = memo[tokenizer_fingerprint] = hashlib.sha256(packed).hexdigest()[:32]
        return key

    @property
    def family(self) -> str:
        """The tokenizer- and engine-independent part of the key: equal for equal specs
        whatever the model and whichever engine serves them (what the edge can give the
        scheduler for grammar-affinity routing: a grammar held for an ``auto`` request
        serves an ``xgrammar`` one's routing as well)."""
        memo = self.__dict__.setdefault("_keys", {})
        family = memo.get(None)
        if family is None:
            fields = self.to_dict()
            fields.pop("engine")
            packed = msgpack.packb([KEY_VERSION, "family"] + [fields[k] for k in sorted(fields)])
            family = memo[None] = hashlib.sha256(packed).hexdigest()[:32]
        return family

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for the compile process's pipe (not for Ray: specs cross Ray as
        objects, with their cached keys)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GrammarSpec":
        return cls(**d)

    def check_repetitions(self, limit: int) -> None:
        """Raises GrammarError (GRAMMAR_TOO_LARGE) naming the first bounded repetition over
        ``limit``: a ``{n}`` / ``{n,m}`` of a regex, of a schema's ``pattern`` (or
        ``patternProperties`` key), of an EBNF grammar (Lark: also ``~ n..m``), or a schema's
        minLength / minItems / minProperties / minContains. Linear in the source, no compile:
        what the cache checks before it queues a compile (``GrammarCacheConfig.max_repetition``).
        Upper bounds of a schema (maxLength, maxItems) are left alone: xgrammar compiles them
        as counters whatever their size, and real schemas use 32767 or 65535 often."""
        if self.kind == "regex":
            _check_counts(self.kind, self.source, limit, _REGEX_TOKENS, "of the regex")
        elif self.kind in ("ebnf", "lark"):
            _check_counts(self.kind, self.source, limit, _GRAMMAR_TOKENS, "of the grammar")
        elif self.kind in ("json_schema", "structural_tag"):
            try:
                _check_schema(self.kind, self.parsed, limit)
            except RecursionError:
                raise GrammarError(f"{self.kind} is nested too deep; flatten it",
                                   ErrorKind.GRAMMAR_TOO_LARGE) from None

    def describe(self) -> str:
        src = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"{self.kind}({src})"


def _canonical_json(value) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"grammar is not JSON-serializable: {exc}") from None


_WRAPPER_KEYS = {"name", "schema", "strict", "description"}
_UNPARSED = object()


def _parse_json(kind: str, text: str):
    """``json.loads`` with every way it fails as a ValueError that names the grammar."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{kind} is not valid JSON: {exc}") from None
    except (ValueError, RecursionError) as exc:  # a 5,000-digit integer; nesting too deep
        raise ValueError(f"{kind} cannot be read: {str(exc) or 'nested too deep'}") from None


def _check_refs(schema) -> None:
    """Only references inside the schema (``#...``) are resolved: a ``$ref`` to a URL or a
    file would make the server fetch it (validation.py never does; this says so early).
    Every object is looked at, data included, in the pass that checks the depth."""
    if nested_deeper(schema, 201, _local_refs_only):
        raise ValueError("json_schema is nested more than 200 levels deep")


def _local_refs_only(node: dict) -> None:
    for key in ("$ref", "$dynamicRef"):
        value = node.get(key)
        if isinstance(value, str) and not is_local(value):
            raise ValueError(f"json_schema {key} {outside(value)}")


# a bounded repetition {n}, {n,}, {,m} or {n,m}, or what must be skipped to find them:
# an escape, a character class (a ']' right after '[' or '[^' is part of it) and, in a
# grammar, a string literal, a comment and Lark's ``~ n`` / ``~ n..m``
_COUNT = r"\{\s*(?P<low>[0-9]*)\s*(?:,\s*(?P<high>[0-9]*)\s*)?\}"
_CLASS = r"\[\^?\]?(?:\\.|[^\]\\])*\]"
_REGEX_TOKENS = re.compile(rf"\\.|{_CLASS}|{_COUNT}", re.S)
_GRAMMAR_TOKENS = re.compile(
    rf'"(?:\\.|[^"\\])*"|{_CLASS}|#[^\n]*|~\s*(?P<tlow>[0-9]+)(?:\s*\.\.\s*(?P<thigh>[0-9]+))?'
    rf"|{_COUNT}", re.S)
_MIN_KEYWORDS = ("minLength", "minItems", "minProperties", "minContains")


def _count(digits: str) -> int:
    # a count too long for int() (over 4,300 digits) is over any limit all the same
    return int(digits) if len(digits) <= 18 else 10**18


def _check_counts(kind: str, text: str, limit: int, tokens: re.Pattern, where) -> None:
    """``where``: the text's place, or a function that says it (built on an error only)."""
    if not re.search("[0-9]{%d}" % len(str(limit)), text):
        return  # no number as long as the limit: nothing over it (the usual case, fast)
    for m in tokens.finditer(text):
        groups = m.groupdict()
        counts = [groups.get(g) for g in ("low", "high", "tlow", "thigh")]
        largest = max((_count(c) for c in counts if c), default=0)
        if largest > limit:
            raise GrammarError(
                f"{kind} grammar: the repetition {_shorten(m.group(0).strip())!r} at "
                f"position {m.start()} {where() if callable(where) else where} repeats "
                f"{largest if largest < 10**18 else 'over 10**18'} times at most, over the "
                f"limit of {limit} (grammar_cache.max_repetition); use a "
                "smaller count, or an unbounded repetition ('*', '+')",
                ErrorKind.GRAMMAR_TOO_LARGE)


def _shorten(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def _check_schema(kind: str, schema, limit: int) -> None:
    """The patterns, grammars and minimum counts of a schema (or structural tag) and of
    every schema inside it."""
    for sub in walk(schema, lenient=True):
        node = sub.node
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("pattern"), str):
            _check_counts(kind, node["pattern"], limit, _REGEX_TOKENS,
                          lambda: f"of the pattern at {pointer((*sub.path, 'pattern'))}")
        if isinstance(node.get("patternProperties"), dict):
            for regex in node["patternProperties"]:
                _check_counts(kind, regex, limit, _REGEX_TOKENS,
                              lambda: f"of the patternProperties key {regex[:60]!r} at "
                                      f"{pointer((*sub.path, 'patternProperties'))}")
        if isinstance(node.get("grammar"), str):  # a structural tag's EBNF
            _check_counts(kind, node["grammar"], limit, _GRAMMAR_TOKENS,
                          lambda: f"of the grammar at {pointer((*sub.path, 'grammar'))}")
        for key in _MIN_KEYWORDS:
            value = node.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > limit:
                raise GrammarError(
                    f"{kind} grammar: {key} {value} at {pointer((*sub.path, key))} is over "
                    f"the limit of {limit} (grammar_cache.max_repetition); lower it",
                    ErrorKind.GRAMMAR_TOO_LARGE)


def _check_choices(choices) -> None:
    if not isinstance(choices, list) or not choices:
        raise ValueError("choice needs a non-empty list of strings")
    if len(choices) > MAX_CHOICES:
        raise GrammarError(f"choice has {len(choices)} options, over the limit of "
                           f"{MAX_CHOICES}", ErrorKind.GRAMMAR_TOO_LARGE)
    if any(not isinstance(c, str) or not c for c in choices):
        raise ValueError("every choice must be a non-empty string")


# the stable id of a spec: what POST /v1/grammars answers and a request's grammar_id names
ID_PREFIX = "grammar-"
_ID = re.compile(re.escape(ID_PREFIX) + "[0-9a-f]{32}")


def grammar_id(spec: GrammarSpec) -> str:
    """The spec's stable id: its key without a tokenizer (``GrammarSpec.key``: kind,
    source, options and engine), so equal specs get equal ids in every process, for
    every model, across restarts."""
    return ID_PREFIX + spec.key("")


def is_grammar_id(text) -> bool:
    """Whether ``text`` is shaped like a ``grammar_id`` (known or not)."""
    return isinstance(text, str) and _ID.fullmatch(text) is not None
