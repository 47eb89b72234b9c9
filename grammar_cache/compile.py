"""Compiles a GrammarSpec with xgrammar, turning every failure into a GrammarError whose
message names the grammar kind and the problem. Used by the engine's GuidedDecodingManager
(and, later, by the shared cache actor), so both compile a spec the same way."""

from __future__ import annotations

import hashlib
import json
import re

import xgrammar as xgr

from grammar_cache.spec import GrammarSpec


_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A grammar that cannot be compiled: invalid schema / regex / syntax, unsupported
    feature, or over a limit. The request that sent it fails; nothing else does."""


def compile_spec(compiler: "xgr.GrammarCompiler", spec: GrammarSpec) -> "xgr.CompiledGrammar":
    try:
        return _compile(compiler, spec)
    except GrammarError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own types
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        message = _SOURCE_PREFIX.sub("", message)  # "[12:00:00] /path/file.cc:83: "
        raise GrammarError(f"invalid {spec.kind} grammar: {message}") from None


def _compile(compiler, spec: GrammarSpec):
    kind = spec.kind
    if kind in ("json_schema", "json_object"):
        schema = spec.source if kind == "json_schema" else '{"type": "object"}'
        return compiler.compile_json_schema(schema, strict_mode=spec.strict,
                                            any_order=spec.any_order, **_json_format(spec))
    if kind == "regex":
        return compiler.compile_regex(spec.source)
    if kind == "ebnf":
        return compiler.compile_grammar(spec.source)
    if kind == "lark":
        return compiler.compile_lark(spec.source)
    if kind == "choice":
        return compiler.compile_grammar(choice_ebnf(json.loads(spec.source)))
    if kind == "structural_tag":
        tag = json.loads(spec.source)
        if "structures" in tag:  # the older {"structures": [...], "triggers": [...]} shape
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                           end=s["end"]) for s in tag["structures"]]
            return compiler.compile_structural_tag(items, tag.get("triggers", []))
        return compiler.compile_structural_tag(spec.source)
    raise GrammarError(f"grammar kind {kind!r} has no compiler")


def _json_format(spec: GrammarSpec) -> dict:
    if spec.whitespace == "compact":
        return dict(any_whitespace=False, separators=(",", ":"))
    if spec.whitespace == "indent":
        return dict(any_whitespace=False, indent=spec.indent)
    if spec.whitespace == "bounded":
        return dict(any_whitespace=True, max_whitespace_cnt=spec.max_whitespace)
    return dict(any_whitespace=True)


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
