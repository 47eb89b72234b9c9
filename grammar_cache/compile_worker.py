"""A grammar-compile child process: ``python -m grammar_cache.compile_worker --memory-mb N``.

Reads frames from stdin and writes one frame per request to stdout; a frame is a 4-byte
big-endian length and a body. It writes b"ready" once its imports are done. Requests
(msgpack): ["tokenizer", fingerprint, tokenizer_json] -> b"ok"; ["compile", fingerprint,
spec dict, key] -> envelope bytes (grammar_cache/envelope.py). Started by CompilePool,
which kills it when a compile runs past its time limit (setup time is not counted).
"""

from __future__ import annotations

import argparse
import resource
import struct
import sys
import time

import msgpack

_LEN = struct.Struct(">I")


def read_frame(stream) -> bytes | None:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    body = stream.read(n)
    return body if len(body) == n else None


def write_frame(stream, body: bytes) -> None:
    stream.write(_LEN.pack(len(body)) + body)
    stream.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory-mb", type=int, default=8192)
    args = ap.parse_args()
    limit = args.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    import xgrammar as xgr

    from grammar_cache import envelope
    from grammar_cache.compile import GrammarError, compile_spec
    from grammar_cache.spec import GrammarSpec

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    compilers: dict[str, object] = {}
    write_frame(stdout, b"ready")
    while (frame := read_frame(stdin)) is not None:
        op, fingerprint, payload, *rest = msgpack.unpackb(frame)
        if op == "tokenizer":
            info = xgr.TokenizerInfo.deserialize_json(payload)
            compilers[fingerprint] = xgr.GrammarCompiler(info, max_threads=1,
                                                         cache_enabled=False)
            write_frame(stdout, b"ok")
            continue
        key = rest[0]
        try:
            spec = GrammarSpec.from_dict(payload)
            t = time.perf_counter()
            compiled = compile_spec(compilers[fingerprint], spec)
            compile_s = time.perf_counter() - t
            serialized = compiled.serialize_json()
            t = time.perf_counter()  # what loading it costs a worker (the cache's policy)
            xgr.CompiledGrammar.deserialize_json(serialized, compiled.tokenizer_info)
            load_s = time.perf_counter() - t
            out = envelope.pack_serialized(serialized, fingerprint, key, compile_s=compile_s,
                                           load_s=load_s)
        except (GrammarError, ValueError) as exc:
            out = envelope.pack_error(str(exc), fingerprint, key)
        except MemoryError:
            out = envelope.pack_error(f"compiling the grammar needed more than "
                                      f"{args.memory_mb} MB", fingerprint, key, kind="memory")
        write_frame(stdout, out)


if __name__ == "__main__":
    main()
