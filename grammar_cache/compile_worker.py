"""A grammar-compile child process: ``python -m grammar_cache.compile_worker --memory-mb N``.

Reads frames from stdin and writes frames to stdout; a frame is a 4-byte big-endian length
and a body. It writes b"ready <xgrammar serialization version>" once its imports are done.
Requests (msgpack): ["tokenizer", fingerprint, tokenizer_json] -> b"ok"; ["compile",
fingerprint, spec dict, key] -> b"compiled" once compiled (not for an error), then two
frames: a small msgpack header ({"error", "error_kind", "compile_s", "load_s",
"load_measured"}, what the cache decides on, so nobody unpacks a large envelope just to read
it; ``load_s`` is measured or estimated from the size, see ``LoadCost``), then the envelope
bytes (grammar_cache/envelope.py). Started by CompilePool, which kills it when a
compile runs past its time limit (setup time is not counted). It dies with the process that
started it (``--parent-pid``; Linux's parent-death signal), even in the middle of a compile,
when it reads no pipe.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import signal
import struct
import sys
import time

import msgpack

_LEN = struct.Struct(">I")
COMPILED = b"compiled"  # sent when the compile itself is done
READY = b"ready "  # + xgrammar's serialization version: sent once the imports are done


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


class LoadCost:
    """What loading a serialized grammar will cost a worker (the cache's verdict policy).
    Loading is xgrammar parsing JSON, close to linear in its size, and a trial load costs
    this process as much as the worker's own (about a second for 40 MB): grammars under
    ``MEASURE_BYTES`` and every ``REMEASURE``-th one are loaded to measure the rate (seconds
    per byte, averaged); the others are estimated from their size."""

    MEASURE_BYTES = 4 * 2**20
    RATE_BYTES = 2**20  # under this, fixed costs dominate: no rate is learned
    REMEASURE = 8

    def __init__(self):
        self.rate: float | None = None
        self.count = 0

    def __call__(self, serialized: str, info) -> tuple[float, bool]:
        """(seconds, measured) for loading ``serialized``."""
        import xgrammar as xgr
        self.count += 1
        size = len(serialized)
        if (self.rate is not None and size >= self.MEASURE_BYTES
                and self.count % self.REMEASURE):
            return self.rate * size, False
        t = time.perf_counter()
        xgr.CompiledGrammar.deserialize_json(serialized, info)
        seconds = time.perf_counter() - t
        if size >= self.RATE_BYTES:
            rate = seconds / size
            self.rate = rate if self.rate is None else 0.5 * (self.rate + rate)
        return seconds, True


# what a compile child takes from xgrammar: its compile, serialization and version API
COMPILE_API = {"compiler": ("CompiledGrammar", "GrammarCompiler"),
               "grammar": ("Grammar", "StructuralTagItem"),
               "tokenizer_info": ("TokenizerInfo",),
               "config": ("get_serialization_version",)}


def import_xgrammar():
    """xgrammar for a compile child, without torch and transformers where it can be.

    ``import xgrammar`` imports torch (its matcher and kernels; tvm_ffi tries it first)
    and transformers (tokenizer_info, for ``from_huggingface``): about 1.9 s of CPU and
    150 MB in every child, which compiles, serializes and loads grammars and needs
    neither. So the package's modules that hold that API (``COMPILE_API``) are imported
    without running its ``__init__``, with torch absent and transformers a stand-in for
    the two class names tokenizer_info imports; both are put back as they were
    afterwards. Where that fails (another xgrammar layout), the plain import; a process
    that has either library already takes the plain import too.
    tests/unit/test_compile_child_unit.py checks that a child's compiles equal the
    plain import's, and that it imported neither library."""
    import importlib
    import importlib.util
    import types

    if "xgrammar" in sys.modules or "torch" in sys.modules or "transformers" in sys.modules:
        import xgrammar
        return xgrammar
    stand_in = types.ModuleType("transformers")
    stand_in.PreTrainedTokenizerBase = stand_in.PreTrainedTokenizerFast = type(
        "NotLoaded", (), {})
    spec = importlib.util.find_spec("xgrammar")
    package = importlib.util.module_from_spec(spec)  # its __init__ is not run
    sys.modules.update({"torch": None, "transformers": stand_in, "xgrammar": package})
    try:
        importlib.import_module("xgrammar.load_binding")  # the library, first (as __init__)
        for module, names in COMPILE_API.items():
            loaded = importlib.import_module(f"xgrammar.{module}")
            for name in names:
                setattr(package, name, getattr(loaded, name))
    except Exception:  # noqa: BLE001 - any failure: forget the partial import, do the plain one
        for name in [m for m in sys.modules if m == "xgrammar" or m.startswith("xgrammar.")]:
            del sys.modules[name]
        package = None
    finally:
        del sys.modules["torch"], sys.modules["transformers"]
    if package is None:
        import xgrammar as package
    return package


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int | None) -> None:
    """Asks the kernel for SIGKILL when the parent dies (Linux; elsewhere nothing), and
    exits now if it already has (it died before the request: this process was adopted)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory-mb", type=int, default=8192)
    ap.add_argument("--parent-pid", type=int, default=None)
    args = ap.parse_args()
    die_with_parent(args.parent_pid)  # first: the imports below take seconds
    limit = args.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    xgr = import_xgrammar()

    from grammar_cache import envelope
    from grammar_cache.compile import compile_spec
    from core.errors import ErrorKind, GrammarError
    from core.grammar_spec import GrammarSpec

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    compilers: dict[str, object] = {}
    load_cost = LoadCost()
    # the serialization version rides on the ready frame: the actor that reads it need not
    # import xgrammar itself (envelope.learn_serialization_version)
    write_frame(stdout, READY + xgr.get_serialization_version().encode())
    while (frame := read_frame(stdin)) is not None:
        op, fingerprint, payload, *rest = msgpack.unpackb(frame)
        if op == "tokenizer":
            info = xgr.TokenizerInfo.deserialize_json(payload)
            compilers[fingerprint] = xgr.GrammarCompiler(info, max_threads=1,
                                                         cache_enabled=False)
            write_frame(stdout, b"ok")
            continue
        key = rest[0]
        header: dict = {}
        try:
            spec = GrammarSpec.from_dict(payload)
            t = time.perf_counter()
            compiled = compile_spec(compilers[fingerprint], spec)
            compile_s = time.perf_counter() - t
            # the time limit is on compiling; serializing and test-loading the result (seconds
            # for hundreds of MB) come after this frame, under the pool's setup allowance
            write_frame(stdout, COMPILED)
            serialized = compiled.serialize_json()
            load_s, measured = load_cost(serialized, compiled.tokenizer_info)
            header = {"compile_s": compile_s, "load_s": load_s, "load_measured": measured}
            out = envelope.pack_serialized(serialized, fingerprint, key, compile_s=compile_s,
                                           load_s=load_s)
            del serialized
        except GrammarError as exc:
            header = {"error": str(exc), "error_kind": exc.kind.value}
        except MemoryError:
            header = {"error": memory_message(payload.get("kind", "grammar"), args.memory_mb),
                      "error_kind": ErrorKind.COMPILE_MEMORY.value}
        except (TypeError, ValueError) as exc:  # a spec dict that does not make a GrammarSpec
            header = {"error": f"invalid grammar spec: {exc}",
                      "error_kind": ErrorKind.INVALID_GRAMMAR.value}
        except Exception as exc:  # noqa: BLE001 - xgrammar outside compile (serialize, load)
            if "bad_alloc" in str(exc):  # C++ allocation failure under the memory limit
                header = {"error": memory_message(payload.get("kind", "grammar"),
                                                  args.memory_mb),
                          "error_kind": ErrorKind.COMPILE_MEMORY.value}
            else:  # not known to be the grammar's fault: transient, not cached
                header = {"error": f"the grammar compile process failed: {exc}; retry",
                          "error_kind": ErrorKind.GRAMMAR_UNAVAILABLE.value}
        if "error" in header:
            out = envelope.pack_error(header["error"], fingerprint, key, header["error_kind"])
        write_frame(stdout, msgpack.packb(header))
        write_frame(stdout, out)


def memory_message(kind: str, memory_mb: int) -> str:
    """What a user reads when compiling their grammar needs more memory than the limit."""
    return (f"compiling this {kind} grammar needs more than the compile memory limit of "
            f"{memory_mb} MB; simplify it (fewer or smaller length bounds, fewer alternatives), "
            "or raise the limit in the cluster config: grammar_cache: {compile_memory_mb: N}")


def timeout_message(kind: str, timeout_s: float) -> str:
    """What a user reads when their (valid) grammar compiles slower than the limit."""
    return (f"compiling this {kind} grammar took longer than the compile time limit of "
            f"{timeout_s:g} s (it may be a correct grammar that is slow to compile): "
            "simplify it (fewer or smaller length bounds, fewer alternatives), or raise the "
            "limit in the cluster config: grammar_cache: {compile_timeout_s: N}")


if __name__ == "__main__":
    main()
