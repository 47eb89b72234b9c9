"""Compiles a GrammarSpec with xgrammar, turning every failure into a GrammarError whose
message names the grammar kind and the problem. Used by the engine's GuidedDecodingManager
(and, later, by the shared cache actor), so both compile a spec the same way."""

from __future__ import annotations

import hashlib
import json
import re

import xgrammar as xgr

from core.errors import GrammarError
from core.grammar_spec import GrammarSpec
from core.json_schema import pointer, walk
from grammar_cache.format_patterns import format_patterns_text

__all__ = ["GrammarError", "compile_spec", "explain_compile_error", "tokenizer_fingerprint"]

_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[12:00:00] /path/file.cc:83: "
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:?\s*")  # xgrammar's CHECK()
# xgrammar parsing the EBNF it generated itself (from a regex or a JSON schema): the line
# and column point into text the user never wrote
_EBNF_POSITION = re.compile(r"^EBNF (?:lexer|parser) error at line \d+, column \d+:\s*")
_REGEX_ERROR = re.compile(r"^Regex parsing error at position (\d+):\s*(.*)$")


def compile_spec(compiler: "xgr.GrammarCompiler", spec: GrammarSpec) -> "xgr.CompiledGrammar":
    """Compiles ``spec``; raises GrammarError (kind INVALID_GRAMMAR) with a message that names
    the grammar kind and the problem in the user's own terms (see ``explain_compile_error``)."""
    try:
        return _compile(compiler, spec)
    except GrammarError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own types
        raise GrammarError(explain_compile_error(spec, exc)) from None


def explain_compile_error(spec: GrammarSpec, exc: BaseException) -> str:
    """xgrammar's error for ``spec`` rewritten for the user: no source-file prefix, no
    internal check expression, no position in EBNF we generated (for regexes, JSON schemas
    and structural tags); for a schema, the pattern at fault and where it is, when one of
    the schema's patterns is what xgrammar refused."""
    text = str(exc).strip()
    detail = _SOURCE_PREFIX.sub("", text.splitlines()[0]) if text else ""
    internal = bool(_CHECK_FAILED.match(detail))
    detail = _CHECK_FAILED.sub("", detail)
    generated = spec.kind != "ebnf" and bool(_EBNF_POSITION.match(detail))
    if generated:
        detail = _EBNF_POSITION.sub("", detail)
    if spec.kind in ("json_schema", "structural_tag") and (
            generated or _REGEX_ERROR.match(detail)):
        culprit = _bad_pattern(spec.parsed)
        if culprit is not None:
            return f"invalid {spec.kind} grammar: {culprit}"
    if spec.kind == "regex":
        m = _REGEX_ERROR.match(detail)
        if m:
            detail = f"{_sentence(m.group(2))} (at position {m.group(1)} of the regex)"
    detail = detail.replace("Invalid structural tag error: ", "")
    if not detail:
        detail = (f"xgrammar refused it without saying why ({type(exc).__name__}"
                  f"{'; an internal check failed' if internal else ''}); simplify it")
    return f"invalid {spec.kind} grammar: {_sentence(detail)}"


def _sentence(text: str) -> str:
    text = text.strip().rstrip(".")
    return text[:1].lower() + text[1:] if text[:2] != text[:2].upper() else text


def _bad_pattern(doc) -> str | None:
    """The first regex of a schema (or structural tag, parsed) that xgrammar refuses on its
    own: "the pattern at /properties/code/pattern ('[z-a]'): <why>"; None if all compile."""
    for where, pattern in _patterns(doc):
        try:
            xgr.Grammar.from_regex(pattern)
        except Exception as exc:  # noqa: BLE001 - xgrammar's errors have no common type
            reason = _SOURCE_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip()
                                        else type(exc).__name__)
            reason = _EBNF_POSITION.sub("", reason)
            m = _REGEX_ERROR.match(reason)
            if m:
                reason = f"{_sentence(m.group(2))} (at position {m.group(1)} of the pattern)"
            return (f"the pattern at {where or '/'} ({pattern!r}) is not a regex xgrammar "
                    f"supports: {_sentence(reason)}")
    return None


def _patterns(doc):
    """(JSON pointer, regex) for every "pattern" string and "patternProperties" key."""
    for sub in walk(doc, lenient=True):
        if not isinstance(sub.node, dict):
            continue
        if isinstance(sub.node.get("pattern"), str):
            yield pointer((*sub.path, "pattern")), sub.node["pattern"]
        if isinstance(sub.node.get("patternProperties"), dict):
            for regex in sub.node["patternProperties"]:
                yield pointer((*sub.path, "patternProperties", regex)), regex


def _compile(compiler, spec: GrammarSpec):
    kind = spec.kind
    if kind in ("json_schema", "json_object"):
        schema = spec.source if kind == "json_schema" else '{"type": "object"}'
        return compiler.compile_grammar(json_schema_ebnf(
            schema, strict_mode=spec.strict, any_order=spec.any_order,
            parsed=spec.parsed, **_json_format(spec)))
    if kind == "regex":
        return compiler.compile_regex(spec.source)
    if kind == "ebnf":
        return compiler.compile_grammar(spec.source)
    if kind == "lark":
        return compiler.compile_lark(spec.source)
    if kind == "choice":
        return compiler.compile_grammar(choice_ebnf(spec.parsed))
    if kind == "structural_tag":
        tag = spec.parsed
        if "structures" in tag:  # the older {"structures": [...], "triggers": [...]} shape
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                           end=s["end"]) for s in tag["structures"]]
            return compiler.compile_structural_tag(items, tag.get("triggers", []))
        return compiler.compile_structural_tag(json.dumps(_tag_json_as_ebnf(tag)))
    raise GrammarError(f"grammar kind {kind!r} has no compiler")


# A double-quoted EBNF literal, or a negated character class (group 1: its body).
_LITERAL_OR_NEGATED_CLASS = re.compile(r'"(?:\\.|[^"\\])*"|\[\^((?:\\.|[^\]\\])*)\]')


def json_schema_ebnf(schema: str, *, max_int_digits: int = 0, max_frac_digits: int = 0,
                     max_exp_digits: int = 0, parsed=None, **options) -> str:
    """xgrammar's EBNF for a JSON schema, with JSON's rule that a string holds no raw
    control character (U+0000-U+001F) enforced everywhere, and the runaway guards on
    numbers (``max_*_digits``; 0: unbounded).

    xgrammar 0.2.8 writes the characters of some strings (those with ``maxLength``, for
    one) as ``[^"\\\r\n]``, which admits raw control characters: a model can then
    emit a tab or U+000F inside a string and the output is not JSON. Every negated class
    in a JSON grammar is a string's character class, so each one gets ``\0-\x1f`` added.

    Numbers: xgrammar writes unbounded digit runs as ``[0-9]*`` or as ``d{n, -1}`` over a
    rule ``d ::= (([0-9]))``; a small model can emit hundreds of digits (the README's
    Saturn example came back with 512). Each unbounded run gets an upper bound: after a
    ``"."`` the fraction bound, after ``[eE]`` and a sign the exponent bound, otherwise
    the integer bound (less the leading ``[1-9]`` when it follows one). A run with a
    larger minimum keeps its minimum as the bound.

    Formats xgrammar writes wider than the post-validation accepts (``email``,
    ``hostname``, ``date`` ...) are written as patterns that match only what it accepts
    (format_patterns.py). ``parsed``: ``schema`` already parsed (``GrammarSpec.parsed``),
    where the caller has it.
    """
    schema = format_patterns_text(schema, max_frac_digits, parsed)
    ebnf = str(xgr.Grammar.from_json_schema(schema, **options))

    def fix(m: re.Match) -> str:
        body = m.group(1)
        if body is None or body.startswith("\\0-\\x1f"):
            return m.group(0)  # a literal, or already excludes the control characters
        return "[^\\0-\\x1f" + body + "]"
    ebnf = _LITERAL_OR_NEGATED_CLASS.sub(fix, ebnf)
    if max_int_digits or max_frac_digits or max_exp_digits:
        ebnf = _bound_digits(ebnf, max_int_digits, max_frac_digits, max_exp_digits)
    return ebnf


_DIGIT_RULE = re.compile(r"^(\w+) ::= \(\(\[0-9\]\)\)$", re.M)
# one or more digits as a right-recursive rule: how xgrammar writes the fraction of a
# ``date-time`` / ``time`` format ("12:30:00.000000000000...", unbounded)
_DIGITS_RULE = re.compile(r"^(\w+) ::= \(\(\[0-9\] \1\) \| \(\[0-9\]\)\)$", re.M)


def _bound_digits(ebnf: str, int_digits: int, frac_digits: int, exp_digits: int) -> str:
    """Bounds the unbounded digit runs of an xgrammar JSON grammar (see json_schema_ebnf).
    A format's digit run (a ``date-time``'s fraction of a second) gets the fraction bound."""
    if frac_digits:
        ebnf = _DIGITS_RULE.sub(lambda m: f"{m.group(1)} ::= (([0-9]{{1, {frac_digits}}}))",
                                ebnf)
    digit_rules = set(_DIGIT_RULE.findall(ebnf))

    def bound(kind: str, lead: bool, low: int) -> int | None:
        limit = {"int": int_digits, "frac": frac_digits, "exp": exp_digits}[kind]
        if not limit:
            return None
        if kind == "int" and lead:
            limit -= 1  # the leading [1-9] is a digit too
        return max(low, limit)

    def kind_before(text: str) -> tuple[str, bool]:
        before = text.rstrip()
        if before.endswith('"."'):
            return "frac", False
        if re.search(r"\[eE\]( \w+)?$", before) or re.search(r"\[\+\\-\]$", before):
            return "exp", False
        return "int", before.endswith("[1-9]")

    out, pos = [], 0
    pattern = re.compile(r"\[0-9\]\*|\b(\w+)\{(\d+), -1\}")
    for m in pattern.finditer(ebnf):
        if m.group(1) is not None and m.group(1) not in digit_rules:
            continue
        line_start = ebnf.rfind("\n", 0, m.start()) + 1
        kind, lead = kind_before(ebnf[line_start:m.start()])
        low = 0 if m.group(1) is None else int(m.group(2))
        high = bound(kind, lead, low)
        if high is None:
            continue
        out.append(ebnf[pos:m.start()])
        what = "[0-9]" if m.group(1) is None else m.group(1)
        out.append(f"{what}{{{low}, {high}}}")
        pos = m.end()
    out.append(ebnf[pos:])
    return "".join(out)


def _tag_json_as_ebnf(node):
    """A structural tag with every ``json_schema`` format replaced by the equivalent
    grammar format from ``json_schema_ebnf`` (the same control-character fix)."""
    if isinstance(node, list):
        return [_tag_json_as_ebnf(n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json" \
            and "json_schema" in node:
        return {"type": "grammar", "grammar": json_schema_ebnf(
            json.dumps(node["json_schema"]), **_json_format(_TAG_JSON))}
    return {k: _tag_json_as_ebnf(v) for k, v in node.items()}


def _json_format(spec: GrammarSpec) -> dict:
    """json_schema_ebnf's options for a spec: the layout and the runaway guards."""
    guards = dict(max_int_digits=spec.max_int_digits, max_frac_digits=spec.max_frac_digits,
                  max_exp_digits=spec.max_exp_digits)
    if spec.whitespace == "compact":
        return dict(any_whitespace=False, separators=(",", ":"), **guards)
    if spec.whitespace == "spaced":  # json.dumps' default separators, one line
        return dict(any_whitespace=False, separators=(", ", ": "), **guards)
    if spec.whitespace == "indent":
        return dict(any_whitespace=False, indent=spec.indent, **guards)
    if spec.whitespace == "bounded":
        return dict(any_whitespace=True, max_whitespace_cnt=spec.max_whitespace, **guards)
    return dict(any_whitespace=True, **guards)


# the JSON inside structural tags (tool calls): the default JSON options of a spec
_TAG_JSON = GrammarSpec("json_object")


def choice_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" ...; each choice is a string literal with its bytes escaped."""
    return "root ::= " + " | ".join(_literal(c) for c in choices)


def _literal(text: str) -> str:
    # xgrammar reads \xHH as a code point, not a byte, so non-ASCII text stays literal
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif not ch.isprintable():
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else ch)
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def tokenizer_fingerprint(info: "xgr.TokenizerInfo") -> str:
    """Identifies a tokenizer for cache keys: its vocabulary, size, type and stop ids."""
    digest = hashlib.sha256(info.serialize_json().encode())
    return digest.hexdigest()[:24]
