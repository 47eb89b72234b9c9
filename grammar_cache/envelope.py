"""The wire format of compiled grammars: a versioned msgpack envelope around xgrammar's
own serialization (``CompiledGrammar.serialize_json``).

    {"v": ENVELOPE_VERSION, "xgr": xgrammar version, "ser": xgrammar serialization version,
     "fp": tokenizer fingerprint, "key": spec key, "grammar": <xgrammar JSON>,
     "compile_s": seconds the compile took, "load_s": seconds deserializing it took}
    or, for a spec that cannot be compiled, the same header with "error" and "error_kind"
    (an ``ErrorKind`` value: the client's fault, or GRAMMAR_UNAVAILABLE for a compile process
    that failed, which is never cached);
    or a "local" verdict: the grammar is known to compile within the limits, and compiling
    it costs less than loading xgrammar's serialization of it, so compile it yourself;
    or a "lease" (the cache's answer to a worker that offered to compile a grammar nobody
    has compiled yet): compile it yourself now, then publish the result to the cache.

``unpack`` raises ``GrammarError`` (with its kind) for a client-fault error,
``GrammarUnavailable`` for a transient one, and refuses an envelope made by another envelope version, another xgrammar (or
serialization) version or for another tokenizer: ``EnvelopeMismatch``, which callers treat
as a miss and recompile, so a stale grammar is never used.
"""

from __future__ import annotations

from importlib.metadata import version

from typing import TYPE_CHECKING

import msgpack

from core.errors import ErrorKind, GrammarError, GrammarUnavailable

if TYPE_CHECKING:
    import xgrammar as xgr

ENVELOPE_VERSION = 3  # 2: error_kind holds ErrorKind values; 3: format fractions bounded
XGRAMMAR_VERSION = version("xgrammar")
_serialization: str | None = None


def serialization_version() -> str:
    """xgrammar's serialization version. Importing xgrammar costs seconds of CPU (it imports
    torch and transformers), so a process that only moves envelopes (the cache actor) learns
    the version from its compile processes (``learn_serialization_version``); any other
    process imports xgrammar here, on first need."""
    global _serialization
    if _serialization is None:
        import xgrammar

        _serialization = xgrammar.get_serialization_version()
    return _serialization


def learn_serialization_version(value: str) -> None:
    """What a compile process of this same installation reported (see compile_worker)."""
    global _serialization
    _serialization = value


class EnvelopeMismatch(RuntimeError):
    """The envelope was made for another version or tokenizer; recompile."""


class CompileLocally(Exception):
    """A verdict envelope: this grammar is safe to compile and cheaper to compile than to
    load; ``compile_s`` is what the cache's compile took."""

    def __init__(self, compile_s: float):
        super().__init__(f"compile locally (about {compile_s:.2f} s)")
        self.compile_s = compile_s


class Leased(Exception):
    """A lease envelope: the asker compiles the grammar itself and publishes it."""


def _header(fingerprint: str, key: str) -> dict:
    return {"v": ENVELOPE_VERSION, "xgr": XGRAMMAR_VERSION,
            "ser": serialization_version(), "fp": fingerprint, "key": key}


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


def pack_lease(fingerprint: str, key: str) -> bytes:
    return msgpack.packb({**_header(fingerprint, key), "lease": True})


def pack_error(message: str, fingerprint: str, key: str,
               kind: ErrorKind = ErrorKind.INVALID_GRAMMAR) -> bytes:
    """An error envelope. ``kind``: a client-fault kind (INVALID_GRAMMAR, GRAMMAR_TOO_LARGE,
    COMPILE_TIMEOUT, COMPILE_MEMORY), or GRAMMAR_UNAVAILABLE for a compile process that
    failed (not the grammar's fault: callers never cache it)."""
    return msgpack.packb({**_header(fingerprint, key), "error": message,
                          "error_kind": ErrorKind(kind).value})


def read_header(data: bytes) -> dict:
    """The decoded envelope (header fields and payload). Anything that is not an envelope,
    empty bytes included, is ``EnvelopeMismatch``, never a msgpack error."""
    if not data:
        raise EnvelopeMismatch("empty reply instead of a grammar envelope")
    try:
        env = msgpack.unpackb(data)
    except (ValueError, msgpack.UnpackException) as exc:
        raise EnvelopeMismatch(f"not a grammar envelope ({exc})") from None
    if not isinstance(env, dict) or "v" not in env:
        raise EnvelopeMismatch("not a rayguide grammar envelope")
    return env


def raise_error(message: str, kind) -> None:
    """Raises what an error envelope of ``kind`` means to a caller: GrammarError for a kind
    that is the client's fault, GrammarUnavailable (transient, retry) for any other."""
    kind = ErrorKind.parse(kind)
    if kind.client_fault:
        raise GrammarError(message, kind)
    raise GrammarUnavailable(message)


def unpack(data: bytes, tokenizer_info: "xgr.TokenizerInfo", fingerprint: str,
           key: str | None = None) -> "xgr.CompiledGrammar":
    """Returns the compiled grammar; raises GrammarError / GrammarUnavailable for an error
    envelope (see ``raise_error``), CompileLocally for a local verdict, Leased for a lease,
    and EnvelopeMismatch when the envelope does not
    belong to this process's versions or to this tokenizer (or to ``key``, when given)."""
    env = read_header(data)
    expected = _header(fingerprint, key if key is not None else env.get("key"))
    for field, want in expected.items():
        if env.get(field) != want:
            raise EnvelopeMismatch(f"envelope {field}={env.get(field)!r}, expected {want!r}")
    if "error" in env:
        raise_error(env["error"], env.get("error_kind"))
    if env.get("lease"):
        raise Leased(key)
    if env.get("local"):
        raise CompileLocally(env.get("compile_s", 0.0))
    import xgrammar

    return xgrammar.CompiledGrammar.deserialize_json(env["grammar"], tokenizer_info)
