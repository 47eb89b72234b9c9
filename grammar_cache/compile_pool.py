"""Grammar compilation in child processes that can be killed.

A compile runs inside xgrammar's C++ code and cannot be interrupted from a thread, and some
real-world schemas take tens of seconds or a lot of memory. So compiles run in a small
pool of child processes (``python -m grammar_cache.compile_worker``, fresh interpreters that
share nothing with the parent), each with an address-space limit; a compile past its time limit gets its process killed and
replaced, and the caller gets a "timeout" error envelope. Other compiles go on in the
other processes meanwhile. Results come back as envelopes (grammar_cache/envelope.py).
"""

from __future__ import annotations

import logging
import os
import queue
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from grammar_cache import envelope
from grammar_cache.compile_worker import read_frame, write_frame
from grammar_cache.spec import GrammarSpec

logger = logging.getLogger(__name__)


@dataclass
class CompileLimits:
    timeout_s: float = 10.0  # wall time of one compile
    memory_mb: int = 8192  # address space of a compile process (a large schema's
    # serialization alone can take hundreds of MB)
    processes: int = 2


SETUP_TIMEOUT_S = 120.0  # starting a child and loading a tokenizer into it


@dataclass
class _Worker:
    process: subprocess.Popen
    fingerprints: set = field(default_factory=set)
    ready: bool = False

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_frame(self, timeout: float) -> bytes | None:
        """The next reply, or None if none came in time or the process died."""
        out = self.process.stdout
        deadline = time.monotonic() + timeout
        while not select.select([out], [], [], 0.05)[0]:
            if not self.alive() or time.monotonic() > deadline:
                return None
        return read_frame(out)

    def request(self, msg: list, timeout: float) -> bytes | None:
        write_frame(self.process.stdin, msgpack.packb(msg))
        return self.wait_frame(timeout)


class CompilePool:
    def __init__(self, limits: CompileLimits | None = None):
        self.limits = limits or CompileLimits()
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._closed = False
        self.timeouts = 0
        for _ in range(self.limits.processes):
            self._idle.put(self._spawn())

    def wait_ready(self, timeout_s: float = SETUP_TIMEOUT_S) -> None:
        """Blocks until every child has finished its imports (so a first compile does not
        wait for them)."""
        workers = [self._idle.get() for _ in range(self.limits.processes)]
        try:
            for w in workers:
                if not w.ready:
                    w.ready = w.wait_frame(timeout_s) == b"ready"
        finally:
            for w in workers:
                self._idle.put(w)

    def _spawn(self) -> _Worker:
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p))
        proc = subprocess.Popen(
            [sys.executable, "-m", "grammar_cache.compile_worker",
             "--memory-mb", str(self.limits.memory_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        return _Worker(proc)

    def compile(self, spec: GrammarSpec, fingerprint: str, tokenizer_json: str,
                key: str, timeout_s: float | None = None) -> bytes:
        """Blocks until the envelope for ``spec`` is ready (an error envelope for an invalid
        grammar, a timeout or a memory overrun). Thread-safe; at most ``processes``
        compiles run at once."""
        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        worker = self._idle.get()
        try:
            if not worker.ready:
                worker.ready = worker.wait_frame(SETUP_TIMEOUT_S) == b"ready"
            if fingerprint not in worker.fingerprints:
                if worker.request(["tokenizer", fingerprint, tokenizer_json],
                                  SETUP_TIMEOUT_S) != b"ok":
                    raise OSError("could not load the tokenizer into the compile process")
                worker.fingerprints.add(fingerprint)
            t = time.monotonic()
            reply = worker.request(["compile", fingerprint, spec.to_dict(), key], timeout)
            if reply is not None:
                return reply
            timed_out = worker.alive()
            worker = self._replace(worker)
            if timed_out:
                self.timeouts += 1
                return envelope.pack_error(
                    f"compiling the {spec.kind} grammar took longer than {timeout:g} s; "
                    "simplify the grammar", fingerprint, key, kind="timeout")
            return envelope.pack_error(
                f"compiling the {spec.kind} grammar crashed its process after "
                f"{time.monotonic() - t:.1f} s (memory limit {self.limits.memory_mb} MB?)",
                fingerprint, key, kind="memory")
        except (BrokenPipeError, OSError) as exc:
            worker = self._replace(worker)
            return envelope.pack_error(f"grammar compile process failed: {exc}",
                                       fingerprint, key, kind="internal")
        finally:
            if not self._closed:
                self._idle.put(worker)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.process.kill()
        worker.process.wait(timeout=10)
        logger.warning("grammar compile process %s killed; starting a new one", worker.process.pid)
        return self._spawn()

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                w = self._idle.get_nowait()
            except queue.Empty:
                break
            try:
                w.process.stdin.close()  # EOF: the child's loop ends
                w.process.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                w.process.kill()
