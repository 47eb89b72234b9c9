"""The wire format of compiled grammars: a versioned msgpack envelope around xgrammar's
own serialization (``CompiledGrammar.serialize_json``).

    {"v": ENVELOPE_VERSION, "xgr": xgrammar version, "ser": xgrammar serialization version,
     "fp": tokenizer fingerprint, "key": spec key, "grammar": <xgrammar JSON>,
     "compile_s": seconds the compile took, "load_s": seconds deserializing it took}
    or, for a spec that cannot be compiled, the same header with "error" and "error_kind";
    or a "local" verdict: the grammar is known to compile within the limits, and compiling
    it costs less than loading xgrammar's serialization of it, so compile it yourself.

``unpack`` refuses an envelope made by another envelope version, another xgrammar (or
serialization) version or for another tokenizer: ``EnvelopeMismatch``, which callers treat
as a miss and recompile, so a stale grammar is never used.
"""

from __future__ import annotations

from importlib.metadata import version

import msgpack
import xgrammar as xgr

from grammar_cache.compile import GrammarError

ENVELOPE_VERSION = 1
XGRAMMAR_VERSION = version("xgrammar")


class EnvelopeMismatch(RuntimeError):
    """The envelope was made for another version or tokenizer; recompile."""


class CompileLocally(Exception):
    """A verdict envelope: this grammar is safe to compile and cheaper to compile than to
    load; ``compile_s`` is what the cache's compile took."""

    def __init__(self, compile_s: float):
        super().__init__(f"compile locally (about {compile_s:.2f} s)")
        self.compile_s = compile_s


def _header(fingerprint: str, key: str) -> dict:
    return {"v": ENVELOPE_VERSION, "xgr": XGRAMMAR_VERSION,
            "ser": xgr.get_serialization_version(), "fp": fingerprint, "key": key}


def pack(compiled: "xgr.CompiledGrammar", fingerprint: str, key: str, *,
         compile_s: float = 0.0, load_s: float = 0.0) -> bytes:
    return pack_serialized(compiled.serialize_json(), fingerprint, key, compile_s=compile_s,
                           load_s=load_s)


def pack_serialized(serialized: str, fingerprint: str, key: str, *, compile_s: float = 0.0,
                    load_s: float = 0.0) -> bytes:
    return msgpack.packb({**_header(fingerprint, key), "grammar": serialized,
                          "compile_s": compile_s, "load_s": load_s})


def pack_local(fingerprint: str, key: str, compile_s: float) -> bytes:
    return msgpack.packb({**_header(fingerprint, key), "local": True, "compile_s": compile_s})


def pack_error(message: str, fingerprint: str, key: str, kind: str = "invalid") -> bytes:
    """kind: "invalid" (the grammar is wrong), "timeout" or "memory" (over a limit), or
    "internal" (the compile process failed; not the grammar's fault, not cached)."""
    return msgpack.packb({**_header(fingerprint, key), "error": message, "error_kind": kind})


def read_header(data: bytes) -> dict:
    env = msgpack.unpackb(data)
    if not isinstance(env, dict) or "v" not in env:
        raise EnvelopeMismatch("not a rayguide grammar envelope")
    return env


def unpack(data: bytes, tokenizer_info: "xgr.TokenizerInfo", fingerprint: str,
           key: str | None = None) -> "xgr.CompiledGrammar":
    """Returns the compiled grammar, raises GrammarError for an error envelope,
    CompileLocally for a local verdict, and EnvelopeMismatch when the envelope does not
    belong to this process's versions or to this tokenizer (or to ``key``, when given)."""
    env = read_header(data)
    expected = _header(fingerprint, key if key is not None else env.get("key"))
    for field, want in expected.items():
        if env.get(field) != want:
            raise EnvelopeMismatch(f"envelope {field}={env.get(field)!r}, expected {want!r}")
    if "error" in env:
        raise GrammarError(env["error"])
    if env.get("local"):
        raise CompileLocally(env.get("compile_s", 0.0))
    return xgr.CompiledGrammar.deserialize_json(env["grammar"], tokenizer_info)
