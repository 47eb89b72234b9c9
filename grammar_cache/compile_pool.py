"""Grammar compilation in child processes that can be killed.

A compile runs inside xgrammar's C++ code and cannot be interrupted from a thread, and some
real-world schemas take tens of seconds or a lot of memory. So compiles run in a small
pool of child processes (``python -m grammar_cache.compile_worker``, fresh interpreters that
share nothing with the parent), each with an address-space limit. The limits come from
``GrammarCacheConfig`` (compile_timeout_s, compile_memory_mb, compile_processes) and
nowhere else.

What a caller gets back is a ``CompileResult``: the envelope bytes plus the header fields
the cache decides on (error and its ErrorKind, compile and load times), so nobody unpacks a
large envelope only to read them. Outcomes:

- compiled, or the grammar is invalid / needs more memory than the limit (the child says
  so): what the child sent;
- past the time limit: the child is killed and replaced; COMPILE_TIMEOUT, with a message
  that gives the limit and the config key that raises it (the grammar is not invalid).
  The limit is the child's CPU time, read from /proc (wall time where that cannot be
  read): on a busy machine a compile's wall time can be many times its CPU time, and a
  client must not be told its valid grammar is too slow because the cores were decoding. A compile that is given less than the limit's CPU time within
  ``WALL_FACTOR`` times the limit is stopped too, as GRAMMAR_UNAVAILABLE (transient,
  never cached: the machine, not the grammar);
- the child died without an answer (killed from outside, the kernel's OOM killer, a crash):
  GRAMMAR_UNAVAILABLE, transient, never cached: the next ask compiles again in a fresh child;
- a repetition over ``max_repetition`` (``GrammarSpec.check_repetitions``): refused without
  a child, GRAMMAR_TOO_LARGE;
- cancelled by the caller (``cancel``, a threading.Event: nobody waits for it any more):
  the child is killed and replaced, GRAMMAR_UNAVAILABLE; a compile cancelled while it
  waits for a free child never takes one.

Children are started from one long-lived thread and ask the kernel to kill them when that
thread's process dies (``compile_worker``: PR_SET_PDEATHSIG): the signal follows the thread
that started a child, so one started from a short-lived thread would die with that thread.

Other compiles go on in the other processes meanwhile.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from grammar_cache import envelope
from grammar_cache.compile_worker import _LEN, COMPILED, READY, timeout_message
from grammar_cache.config import GrammarCacheConfig
from core.errors import ErrorKind, GrammarError
from core.grammar_spec import GrammarSpec

logger = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 120.0
# every child is started from this one thread: it lives as long as the process, and a
# child's parent-death signal fires when the thread that started it ends
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile-spawn")
WALL_FACTOR = 3.0  # a compile's wall-time backstop, in multiples of its CPU-time limit
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # starting a child and loading a tokenizer into it


@dataclass
class CompileResult:
    """One compile's outcome: ``data`` is the envelope; the rest is its header."""

    data: bytes
    error: str | None = None
    error_kind: ErrorKind | None = None
    compile_s: float = 0.0
    load_s: float = 0.0

    @property
    def cacheable(self) -> bool:
        """A compiled grammar or the client's fault; never a transient failure."""
        return self.error_kind is None or self.error_kind.client_fault


def _is_ready(frame: bytes | None) -> bool:
    if frame is None or not frame.startswith(READY):
        return False
    envelope.learn_serialization_version(frame[len(READY):].decode())
    return True


@dataclass
class _Worker:
    process: subprocess.Popen
    fingerprints: set = field(default_factory=set)
    ready: bool = False
    timed_out: bool = False  # the last wait_frame ran out of time (not: the process died)
    cancelled: bool = False  # the last wait_frame ended because its caller cancelled
    starved: bool = False  # the last wait_compile ran out of wall time, not of CPU time

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_frame(self, timeout: float, cancel: threading.Event | None = None) -> bytes | None:
        """The next reply, or None if none came in time, the process died or ``cancel`` was
        set. The pipe is unbuffered on this side: a buffered reader could swallow the next
        frame into its buffer, where select() cannot see it, and the wait for it would run
        out."""
        out = self.process.stdout
        deadline = time.monotonic() + timeout
        self.timed_out = self.cancelled = False
        while not select.select([out], [], [], 0.05)[0]:
            if not self.alive():
                return None
            if cancel is not None and cancel.is_set():
                self.cancelled = True
                return None
            if time.monotonic() > deadline:
                self.timed_out = True  # alive and silent: what a time limit means
                return None
        head = _read_exact(out, _LEN.size)  # None at end of file: the process died
        if head is None:
            return None
        return _read_exact(out, _LEN.unpack(head)[0])

    def cpu_seconds(self) -> float | None:
        """The child's CPU time so far (user + system), or None where /proc has none."""
        try:
            with open(f"/proc/{self.process.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
        except (OSError, IndexError, ValueError):
            return None

    def wait_compile(self, cpu_limit: float, cancel: threading.Event | None = None) -> bytes | None:
        """Like wait_frame, with ``cpu_limit`` seconds of the child's CPU time as the limit
        and ``WALL_FACTOR`` times it as the wall-time backstop. After a None that ran out of
        time, ``starved`` says whether the child had less than its CPU time."""
        self.starved = False
        start = self.cpu_seconds()
        hard = time.monotonic() + WALL_FACTOR * cpu_limit
        wait = cpu_limit
        while True:
            frame = self.wait_frame(wait, cancel)
            if frame is not None or not self.timed_out:
                return frame
            now_cpu = self.cpu_seconds()
            if start is None or now_cpu is None:
                return None  # no CPU clock here: the limit is wall time
            used = now_cpu - start
            if used >= 0.95 * cpu_limit:
                return None
            if time.monotonic() >= hard:
                self.starved = True
                return None
            wait = min(max(cpu_limit - used, 0.1), hard - time.monotonic())

    def send(self, msg: list) -> None:
        body = msgpack.packb(msg)
        view = memoryview(_LEN.pack(len(body)) + body)
        while view:  # the pipe is unbuffered: a write may take only part
            view = view[self.process.stdin.write(view):]

    def request(self, msg: list, timeout: float) -> bytes | None:
        self.send(msg)
        return self.wait_frame(timeout)


class CompilePool:
    """``processes`` child processes (default: ``config.compile_processes``) compiling under
    ``config``'s time and memory limits."""

    def __init__(self, config: GrammarCacheConfig | None = None, processes: int | None = None,
                 start: int | None = None):
        """``start``: how many children start now (default all); the others start when a
        compile finds every started child busy. Each child's imports cost seconds of CPU,
        which a runtime's start should not pay for compiles that may never overlap."""
        self.config = config or GrammarCacheConfig()
        self.processes = processes or self.config.compile_processes
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()
        self.busy: dict[int, str] = {}  # pid -> key being compiled (for operators and tests)
        self.timeouts = 0
        self.starved = 0  # compiles stopped at the wall-time backstop (a busy machine)
        self.crashes = 0
        self.cancelled = 0  # compiles stopped because nobody waited for them any more
        self.started = self.processes if start is None else max(1, min(start, self.processes))
        for _ in range(self.started):
            self._idle.put(self._spawn())

    def wait_ready(self, timeout_s: float = SETUP_TIMEOUT_S) -> None:
        """Blocks until every child started so far has finished its imports (so a first
        compile does not wait for them); raises RuntimeError if one did not start."""
        workers = [self._idle.get() for _ in range(self.started)]
        failed = []
        try:
            for i, w in enumerate(workers):
                if not w.ready:
                    w.ready = _is_ready(w.wait_frame(timeout_s))
                    if not w.ready:
                        failed.append(w.process.pid)
                        workers[i] = self._replace(w)
        finally:
            for w in workers:
                self._idle.put(w)
        if failed:
            raise RuntimeError(f"grammar compile process(es) {failed} did not start within "
                               f"{timeout_s:g} s")

    def _grow(self) -> None:
        """Starts one more child in the background; it joins the idle ones once its imports
        are done (a compile waiting meanwhile takes whichever child is free first)."""
        with self._lock:
            if self.started >= self.processes or self._closed:
                return
            self.started += 1

        def warm() -> None:
            worker = self._spawn()
            worker.ready = _is_ready(worker.wait_frame(SETUP_TIMEOUT_S))
            if self._closed:
                _stop(worker)
            else:  # one that did not start is replaced on first use, as after a crash
                self._idle.put(worker)

        threading.Thread(target=warm, name="grammar-compile-grow", daemon=True).start()

    def _spawn(self) -> _Worker:
        try:
            return _Worker(_SPAWNER.submit(self._popen).result())
        except RuntimeError:  # the interpreter is exiting (no new threads): from here
            return _Worker(self._popen())

    def _popen(self) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p))
        return subprocess.Popen(
            [sys.executable, "-m", "grammar_cache.compile_worker",
             "--memory-mb", str(self.config.compile_memory_mb),
             "--parent-pid", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)

    def compile(self, spec: GrammarSpec, fingerprint: str, tokenizer_json: str,
                key: str | None = None, timeout_s: float | None = None,
                cancel: threading.Event | None = None) -> CompileResult:
        """Blocks until ``spec`` is compiled or has failed (see the module docstring for the
        outcomes). Thread-safe; at most ``processes`` compiles run at once. ``cancel``: set
        it to stop the compile (its child is killed within 50 ms)."""
        key = spec.key(fingerprint) if key is None else key
        timeout = self.config.compile_timeout_s if timeout_s is None else timeout_s
        try:
            spec.check_repetitions(self.config.max_repetition)
        except GrammarError as exc:
            return self._error(str(exc), exc.kind, fingerprint, key)
        if self._idle.empty():
            self._grow()
        worker = self._take(cancel)
        if worker is None:  # cancelled while every child was busy
            self.cancelled += 1
            return self._error(f"the compile of this {spec.kind} grammar was cancelled "
                               "(nobody waits for it any more); retry",
                               ErrorKind.GRAMMAR_UNAVAILABLE, fingerprint, key)
        t = time.monotonic()
        busy_pid = None
        try:
            if not worker.ready:
                worker.ready = _is_ready(worker.wait_frame(SETUP_TIMEOUT_S))
            if fingerprint not in worker.fingerprints:
                if worker.request(["tokenizer", fingerprint, tokenizer_json],
                                  SETUP_TIMEOUT_S) != b"ok":
                    raise OSError("could not load the tokenizer into the compile process")
                worker.fingerprints.add(fingerprint)
            busy_pid = worker.process.pid
            with self._lock:
                self.busy[busy_pid] = key
            t = time.monotonic()
            worker.send(["compile", fingerprint, spec.to_dict(), key])
            head = worker.wait_compile(timeout, cancel)
            compiled = head == COMPILED
            if compiled:  # the limit was kept; serializing it may take a while
                head = worker.wait_frame(SETUP_TIMEOUT_S, cancel)
            # the envelope follows its header at once
            data = worker.wait_frame(SETUP_TIMEOUT_S) if head is not None else None
            if data is not None:
                h = msgpack.unpackb(head)
                kind = h.get("error_kind")
                return CompileResult(data, h.get("error"),
                                     ErrorKind.parse(kind) if kind else None,
                                     h.get("compile_s", 0.0), h.get("load_s", 0.0))
            # a kill from outside closes the pipe before the process can be reaped, so
            # "alive" is no test here: only a wait that ran out of time is a timeout
            timed_out = worker.timed_out and not compiled
            starved = timed_out and worker.starved
            cancelled = worker.cancelled
            pid, code = worker.process.pid, worker.process.poll()
            worker = self._replace(worker)
            if cancelled:
                self.cancelled += 1
                return self._error(f"the compile of this {spec.kind} grammar was cancelled "
                                   "(nobody waits for it any more); retry",
                                   ErrorKind.GRAMMAR_UNAVAILABLE, fingerprint, key)
            if starved:
                self.starved += 1
                logger.warning("compiling %s got under %g s of CPU time in %.1f s (the "
                               "machine is busy); stopped, the request may retry",
                               spec.describe(), timeout, time.monotonic() - t)
                return self._error(
                    f"this {spec.kind} grammar could not be compiled in time because the "
                    f"machine is busy (it got under {timeout:g} s of CPU time in "
                    f"{time.monotonic() - t:.0f} s); it is not known to be a problem with the "
                    "grammar: retry", ErrorKind.GRAMMAR_UNAVAILABLE, fingerprint, key)
            if timed_out:
                self.timeouts += 1
                return self._error(timeout_message(spec.kind, timeout), ErrorKind.COMPILE_TIMEOUT,
                                   fingerprint, key)
            self.crashes += 1
            logger.warning("grammar compile process %s died (exit status %s) after %.1f s "
                           "compiling %s", pid, code, time.monotonic() - t, spec.describe())
            return self._error(
                f"the grammar compile process died (exit status {code}) while compiling this "
                f"{spec.kind} grammar; this is not known to be a problem with the grammar: retry",
                ErrorKind.GRAMMAR_UNAVAILABLE, fingerprint, key)
        except (BrokenPipeError, OSError) as exc:
            self.crashes += 1
            worker = self._replace(worker)
            return self._error(f"the grammar compile process failed ({exc}); retry",
                               ErrorKind.GRAMMAR_UNAVAILABLE, fingerprint, key)
        finally:
            with self._lock:
                self.busy.pop(busy_pid, None)
            if not self._closed:
                self._idle.put(worker)
            else:
                _stop(worker)

    def _take(self, cancel: threading.Event | None) -> _Worker | None:
        """The next idle child (waiting while all are busy), or None once ``cancel`` is
        set: a compile nobody waits for must not take a child after its waiters left."""
        while True:
            if cancel is not None and cancel.is_set():
                return None
            try:
                return self._idle.get(timeout=0.05)
            except queue.Empty:
                continue

    @staticmethod
    def _error(message: str, kind: ErrorKind, fingerprint: str, key: str) -> CompileResult:
        return CompileResult(envelope.pack_error(message, fingerprint, key, kind), message, kind)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.process.kill()
        worker.process.wait(timeout=10)
        logger.warning("grammar compile process %s stopped; starting a new one",
                       worker.process.pid)
        return self._spawn()

    def close(self) -> None:
        """Stops the idle children; a child still compiling stops when its compile ends."""
        self._closed = True
        while True:
            try:
                w = self._idle.get_nowait()
            except queue.Empty:
                break
            _stop(w)


def _read_exact(raw, n: int) -> bytes | None:
    """n bytes from an unbuffered pipe (blocking), or None at end of file."""
    buf = bytearray(n)
    view, pos = memoryview(buf), 0
    while pos < n:
        got = raw.readinto(view[pos:])
        if not got:
            return None
        pos += got
    return bytes(buf)


def _stop(w: _Worker) -> None:
    try:
        w.process.stdin.close()  # EOF: the child's loop ends
        w.process.wait(timeout=2)
    except (OSError, subprocess.TimeoutExpired):
        w.process.kill()
