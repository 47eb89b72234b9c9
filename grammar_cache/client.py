"""The worker-side client of the grammar cache actor.

``fetch(spec)`` returns a compiled grammar, blocking; the engine's GuidedDecodingManager
calls it on its compile threads (never on the step loop) and keeps the results in its own
local LRU. It raises ``GrammarError`` (with its ErrorKind) for a grammar the client must
change, ``GrammarUnavailable`` for a transient failure (never to be cached).

Paths, each bounded by the limits of the one ``GrammarCacheConfig``:

- **actor**: the first contact with an actor waits for its readiness (``ready()``, up to
  ``ready_timeout_s``: a fresh actor is still starting its compile processes), later ones
  ping it (2 s, so a restarting actor does not hold a request for the long RPC timeout).
  The tokenizer is registered once per actor life, retried with backoff; an actor that
  answers None (it restarted and forgot the tokenizer) gets it again.
- **compile-locally verdict**: the actor proved the grammar compiles within the limits and
  that loading xgrammar's serialization of it costs more than compiling it. It is compiled
  in this process, since a child process would have to hand it back serialized, which is
  exactly the cost the verdict avoids. Bounded by a watchdog: one such compile at a time
  (so this process's memory holds at most one compile, which the actor's child already ran
  under ``compile_memory_mb``), and a caller waits at most ``compile_timeout_s``: past it,
  the request fails with GrammarUnavailable and a log line (the grammar is known to be
  fine; this worker is too loaded), while the compile thread, which xgrammar cannot
  interrupt, runs to its end. While that slot is taken, verdicts compile in the fallback
  child process instead (killable, slower to hand back).
- **first compile here** (a lease): for a grammar nobody in the cluster has compiled, and
  that looks ordinary (``GrammarCacheConfig.worker_first_compile`` and its size and digit
  bounds), the client asks the actor for a lease, compiles in this process, answers its
  request with the result, and publishes the envelope from a background thread (xgrammar
  releases the GIL while serializing): the request waits for the compile alone, not for a
  child's serialization and this process's load of it. The compile shares the verdicts'
  one in-process slot and its watchdog reads the compile thread's **CPU time**: past
  ``compile_timeout_s`` (or the wall-time backstop) the lease goes back to the actor, whose
  killable child compiles it under the limits and says what is wrong (a compile_timeout
  error, or the grammar). A grammar error found here is published as the grammar's error.
- **disk** (grammar_cache/disk.py), first: an envelope this node kept (written by the
  actor or by a worker) is loaded without asking the actor; what the actor sends is written
  there (in the background) for the node's next worker or the next start of the cluster.
- **local fallback**: actor not found, dead, not ready in time, or its envelope does not
  match this process: compile in this client's own child process (started warm at
  construction, same limits), log once per outage, skip the actor for ``retry_after_s``.

Refused before any of these: a grammar with a repetition over ``max_repetition``
(GrammarError, grammar_too_large; no call to the actor). A full compile queue in the actor
is GrammarUnavailable with kind OVERLOADED, never a local compile (that would spend this
worker's cores on what the actor refused). A call to the actor that times out, or whose
caller stops waiting (``fetch``'s ``cancel``: the engine's request gave up on its grammar),
is cancelled there, so the actor drops the compile if nobody else waits for it.

Everything is counted in ``stats()``; a fallback is never silent.

Why one module over 500 lines: the four paths below share one connection state (the actor's
handle, its readiness, the registered tokenizer) and one set of limits; they are one
state machine, read top to bottom.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import re
import threading
import time

import ray
import xgrammar as xgr

from grammar_cache import disk as disk_tier
from grammar_cache import envelope
from grammar_cache.actor import ACTOR_NAME, LEASE_SERIALIZE_S, NAMESPACE
from core.backoff import backoff
from grammar_cache.compile import GrammarError, compile_spec, tokenizer_fingerprint
from grammar_cache.compile_pool import WALL_FACTOR, CompilePool
from grammar_cache.config import GrammarCacheConfig
from core.errors import ErrorKind, GrammarUnavailable
from core.grammar_spec import GrammarSpec
from grammar_cache.stats import ClientStats

logger = logging.getLogger(__name__)

FALLBACK_WARM_DELAY_S = 20.0
FALLBACK_WARM_QUIET_S = 10.0  # ... and once no grammar was fetched for this long

REGISTER_ATTEMPTS = 4  # backoff 0.1, 0.2, 0.4 s between them
# what loading xgrammar's JSON costs per byte (the slow end of 2-core machines), for the
# verdict on a grammar compiled here: publish the grammar, or a compile-locally verdict
LOAD_S_PER_BYTE = 25e-3 / 2**20
WATCHDOG_POLL_S = 0.02
PUBLISH_NICE = 10
TRIM_AFTER_BYTES = 2**20  # envelopes this big are worth a malloc_trim after loading


class GrammarCacheClient:
    def __init__(self, tokenizer_info: "xgr.TokenizerInfo",
                 config: GrammarCacheConfig | None = None, *, name: str = ACTOR_NAME,
                 namespace: str = NAMESPACE, rpc_timeout_s: float | None = None,
                 ping_timeout_s: float = 2.0, retry_after_s: float = 5.0):
        """``config``: the cluster's grammar cache settings; its limits bound every
        compile this client makes."""
        self.config = config = config or GrammarCacheConfig()
        self.info = tokenizer_info
        self.fingerprint = tokenizer_fingerprint(tokenizer_info)
        self._tokenizer_json = tokenizer_info.serialize_json()
        self.name, self.namespace = name, namespace
        # an actor compile can take up to its own limit; allow for transfer on top
        # the actor's compile may run up to WALL_FACTOR x its CPU-time limit on a busy machine
        self.rpc_timeout_s = rpc_timeout_s or WALL_FACTOR * config.compile_timeout_s + 15.0
        self.ping_timeout_s = ping_timeout_s
        self.retry_after_s = retry_after_s
        self._actor = None
        self._actor_ready = False  # this handle answered ready() once
        self._registered = False
        self._local: CompilePool | None = None
        self._lock = threading.Lock()
        self._warned = False
        self._down_until = 0.0  # after a failure, skip the actor until then
        self._in_process = None
        # one in-process compile at a time (verdicts and leases); _stuck: its holder is a
        # compile past its limit (xgrammar cannot stop it), so leases are not asked for
        self._slot = threading.Semaphore(1)
        self._stuck = False
        self._digits = re.compile(r"\d{%d,}" % config.worker_compile_max_digits)
        self.counts = ClientStats()
        self.disk = disk_tier.from_config(config)
        # the fallback's compile process starts in the background, FALLBACK_WARM_DELAY_S
        # after this client: started only when the actor fails, it would make every
        # request wait for its imports (seconds, tens of seconds on a loaded machine)
        # exactly when the cache is down; started at once, its imports would slow the
        # runtime's own start (every process competes for the same cores then)
        # (and not while grammars are being fetched: a cold cluster's first burst of
        # compiles needs every core it can get; the imports wait for a quieter moment)
        self._fetching, self._last_fetch, self._closed = 0, 0.0, False
        self._warm_timer = None
        self._arm_warmup(FALLBACK_WARM_DELAY_S)

    # the one entry point ------------------------------------------------------------

    def fetch(self, spec: GrammarSpec, client: str | None = None,
              cancel: threading.Event | None = None) -> "xgr.CompiledGrammar":
        """The compiled grammar for ``spec``. Raises GrammarError (the client's to fix, with
        its ``kind``) or GrammarUnavailable (transient: retry; never cache it; its ``kind``
        is OVERLOADED when the actor's compile queue was full). ``client``: who the request
        is for (an API key's hash, an address), so the actor shares its compile processes
        fairly between clients; None: one shared line. ``cancel``: set when nobody waits
        for the grammar any more: the call to the actor is cancelled (the actor drops the
        compile if nobody else waits for it) and GrammarUnavailable raised."""
        t = time.monotonic()
        with self._lock:
            self._fetching += 1
        try:
            return self._fetch(spec, client, cancel)
        except GrammarUnavailable:
            with self._lock:
                self.counts.unavailable += 1
            raise
        finally:
            wait = time.monotonic() - t
            with self._lock:
                self._fetching -= 1
                self._last_fetch = time.monotonic()
                self.counts.fetches += 1
                self.counts.fetch_wait_s += wait
                self.counts.fetch_wait_max_s = max(self.counts.fetch_wait_max_s, wait)

    def stats(self) -> dict:
        """This client's counters (``ClientStats``, grammar_cache/stats.py) as the dict the
        worker's ``load()`` carries over Ray, ``actor_skipped`` set as of now."""
        with self._lock:
            counts = dataclasses.replace(self.counts,
                                         actor_skipped=time.monotonic() < self._down_until)
        return counts.as_dict()

    def _fetch(self, spec: GrammarSpec, client: str | None = None,
               cancel: threading.Event | None = None):
        spec.check_repetitions(self.config.max_repetition)
        key = spec.key(self.fingerprint)
        if self.disk is not None:
            data = self.disk.get(self.fingerprint, key)
            if data is not None:
                try:
                    compiled = self._unpack(data, key)
                    with self._lock:
                        self.counts.disk_hits += 1
                    return compiled
                except envelope.CompileLocally:
                    with self._lock:
                        self.counts.disk_hits += 1
                        self.counts.verdicts += 1
                    return self._compile_verdict(spec)
                except (envelope.EnvelopeMismatch, GrammarUnavailable):
                    pass  # not ours after all (or an error): ask the actor
        data = self._from_actor(spec, lease=self._may_compile_here(spec), client=client,
                                cancel=cancel)
        if data is not None:
            try:
                compiled = self._unpack(data, key)
                with self._lock:
                    self.counts.actor_hits += 1
                self._keep(key, data)
                return compiled
            except envelope.Leased:
                return self._compile_leased(spec, key)
            except envelope.CompileLocally:
                with self._lock:
                    self.counts.verdicts += 1
                self._keep(key, data)
                return self._compile_verdict(spec)
            except envelope.EnvelopeMismatch as exc:
                self._fallback(f"its envelope does not match this worker ({exc})")
        with self._lock:
            self.counts.local_fallbacks += 1
        return self._compile_in_child(spec, key)

    def _unpack(self, data: bytes, key: str):
        """``envelope.unpack`` for this worker; after loading a big grammar, the heap's
        free memory goes back to the system (``_trim_heap``), since parsing leaves many
        times the grammar's size behind in the loading thread's arena."""
        try:
            return envelope.unpack(data, self.info, self.fingerprint, key)
        except GrammarUnavailable as exc:  # the envelope's kind (overloaded) rides along
            kind = ErrorKind.parse(envelope.read_header(data).get("error_kind"))
            raise GrammarUnavailable(str(exc), kind if kind.transient else exc.kind) from None
        finally:
            if len(data) >= TRIM_AFTER_BYTES:
                _trim_heap()

    def _may_compile_here(self, spec: GrammarSpec) -> bool:
        """Whether to offer to compile ``spec`` here if nobody has yet: an ordinary-looking
        grammar (see GrammarCacheConfig.worker_first_compile), and no compile past its
        limit holding this process's slot."""
        c = self.config
        return (c.worker_first_compile and not self._stuck
                and len(spec.source) <= c.worker_compile_max_source_bytes
                and self._digits.search(spec.source) is None)

    def _keep(self, key: str, data: bytes) -> None:
        """Writes what the actor sent to this node's disk, unless it is there already (the
        actor on this node wrote it), on a thread of its own: the request does not wait."""
        if self.disk is None or self.disk.has(self.fingerprint, key):
            return

        def write():
            if self.disk.put(self.fingerprint, key, data):
                with self._lock:
                    self.counts.disk_writes += 1
        threading.Thread(target=write, name="grammar-disk-write", daemon=True).start()

    # the actor ----------------------------------------------------------------------

    def _from_actor(self, spec: GrammarSpec, lease: bool = False, client: str | None = None,
                    cancel: threading.Event | None = None) -> bytes | None:
        """Envelope bytes from the actor, or None (after logging) to compile locally. Never
        returns an empty reply. ``lease``: offer to compile it here (see the module
        docstring); the reply may then be a lease envelope."""
        if time.monotonic() < self._down_until:
            return None  # it failed a moment ago: compile locally without waiting on it
        try:
            actor = self._ready_actor()
            for _ in range(2):
                if not self._registered:
                    self._register(actor)
                # a wait on another worker's lease may last its compile and serialization
                ref = actor.get.remote(spec, self.fingerprint, lease, client)
                try:
                    data = _get(ref, self.rpc_timeout_s + LEASE_SERIALIZE_S, cancel)
                except (ray.exceptions.GetTimeoutError, _Cancelled):
                    ray.cancel(ref)  # the actor drops the compile if nobody else waits
                    raise
                if data:
                    self._reachable()
                    return data
                self._registered = False  # a restarted actor forgot our tokenizer
            raise RuntimeError("the actor does not keep this worker's tokenizer")
        except _Cancelled:  # nobody waits: neither the actor's fault nor a local compile
            raise GrammarUnavailable(f"the compile of this {spec.kind} grammar was "
                                     "cancelled (nobody waits for it any more); retry") from None
        except Exception as exc:  # noqa: BLE001 - not found, dead, restarting, timed out
            self._actor = None
            self._actor_ready = self._registered = False
            self._down_until = time.monotonic() + self.retry_after_s
            with self._lock:
                self.counts.actor_failures += 1
            self._fallback(f"unavailable ({type(exc).__name__}: {exc})")
            return None

    def _ready_actor(self):
        actor = self._handle()
        if not self._actor_ready:
            # a new actor answers once its compile processes are up: wait for that
            # (not the short ping), or a fresh cluster compiles everything locally
            t = self.config.ready_timeout_s
            if not ray.get(actor.ready.remote(t), timeout=t + 5):
                raise TimeoutError(f"not ready within {t:g} s")
            self._actor_ready = True
        else:
            # a dead or restarting actor must not hold this compile for the long timeout
            ray.get(actor.ping.remote(), timeout=self.ping_timeout_s)
        return actor

    def register(self) -> None:
        """Gives the actor this worker's tokenizer now, before any request needs it (the
        replicator calls it when the actor says it lacks it: a worker that has served no
        guided request yet, or an actor that restarted). Raises where the actor is not
        there; requests do not depend on it (their fetch registers too)."""
        self._register(self._ready_actor())

    def _register(self, actor) -> None:
        """Registers the tokenizer, retrying with backoff (0.1, 0.2, 0.4 s)."""
        delays = backoff(0.1)
        for attempt in range(REGISTER_ATTEMPTS):
            try:
                ray.get(actor.register_tokenizer.remote(self.fingerprint, self._tokenizer_json),
                        timeout=self.rpc_timeout_s)
                self._registered = True
                with self._lock:
                    self.counts.registrations += 1
                return
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError,
                    ray.exceptions.ActorUnavailableError):
                if attempt == REGISTER_ATTEMPTS - 1:
                    raise
                with self._lock:
                    self.counts.registration_retries += 1
                time.sleep(next(delays))

    def _handle(self):
        if self._actor is None:
            if not ray.is_initialized():
                raise RuntimeError("Ray is not initialized")
            self._actor = ray.get_actor(self.name, namespace=self.namespace)
            self._actor_ready = self._registered = False
        return self._actor

    def _fallback(self, why: str) -> None:
        """One log line per outage: from here on this worker compiles by itself."""
        if not self._warned:
            logger.warning("grammar cache actor %r %s; compiling grammars in this worker "
                           "(counted in stats().local_fallbacks)", self.name, why)
            self._warned = True

    def _reachable(self) -> None:
        if self._warned:
            logger.info("grammar cache actor %r reachable again", self.name)
            self._warned = False

    # compiling here -----------------------------------------------------------------

    def _compile_leased(self, spec: GrammarSpec, key: str):
        """The first compile of ``spec`` in the cluster, here, under a lease from the actor;
        see the module docstring."""
        limit = self.config.compile_timeout_s
        if self._stuck or not self._slot.acquire(timeout=limit):
            return self._give_back(spec, key)
        thread, done, box = self._compile_on_slot(spec, "grammar-first-compile")
        try:
            clock = time.pthread_getcpuclockid(thread.ident)
        except (AttributeError, OSError):  # no per-thread CPU clock: wall time only
            clock = None
        wall_limit = time.monotonic() + WALL_FACTOR * limit
        while not done.wait(WATCHDOG_POLL_S):
            try:
                cpu = time.clock_gettime(clock) if clock is not None else 0.0
            except OSError:  # the thread ended between the wait and the read
                continue
            if cpu > limit or time.monotonic() > wall_limit:
                with self._lock:
                    if done.is_set():  # it finished after all
                        break
                    self._stuck = True
                with self._lock:
                    self.counts.worker_compile_timeouts += 1
                logger.warning("the first compile of %s passed the compile limit (%g s) in "
                               "this worker; the grammar cache compiles it in a child process "
                               "(this compile runs on: xgrammar cannot stop it)",
                               spec.describe(), limit)
                return self._give_back(spec, key)
        if "error" in box:
            exc = box["error"]
            if isinstance(exc, GrammarError):  # the grammar's own error, for everyone
                self._publish(key, envelope.pack_error(str(exc), self.fingerprint, key,
                                                       exc.kind))
                raise exc
            # not known to be the grammar's fault (memory, ...): the child decides
            return self._give_back(spec, key)
        compiled, compile_s = box["grammar"], box["compile_s"]
        with self._lock:
            self.counts.worker_compiles += 1
        self._publish(key, lambda: self._pack(compiled, key, compile_s))
        return compiled

    def _pack(self, compiled, key: str, compile_s: float) -> bytes:
        """What to publish for a grammar compiled here: its serialization, or a verdict where
        loading that would cost more than compiling (as the actor decides for its own)."""
        if _grammar_bytes(compiled) > self.config.worker_publish_max_grammar_bytes:
            # xgrammar's JSON of it could take gigabytes to write (about 15x its size, and it
            # is 3-35x the grammar's memory): say it compiles, and where, without it
            return envelope.pack_local(self.fingerprint, key, compile_s)
        serialized = compiled.serialize_json()
        load_s = len(serialized) * LOAD_S_PER_BYTE
        if load_s >= self.config.local_verdict_factor * compile_s:
            return envelope.pack_local(self.fingerprint, key, compile_s)
        return envelope.pack_serialized(serialized, self.fingerprint, key,
                                        compile_s=compile_s, load_s=load_s)

    def _publish(self, key: str, data) -> None:
        """Sends the lease's result to the actor from a thread of its own (``data``: bytes,
        or a callable making them there: serializing takes seconds for large grammars)."""

        start = time.monotonic()

        def run():
            # a lower CPU priority, this thread only: serializing takes about as long as the
            # compile did, and requests waiting for compiles go first (not the lowest: on a
            # saturated machine that starved publications that other workers waited for)
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PUBLISH_NICE)
            except (AttributeError, OSError):
                pass
            try:
                body = data() if callable(data) else data
                ok = ray.get(self._handle().publish.remote(self.fingerprint, key, body),
                             timeout=self.rpc_timeout_s)
                took = time.monotonic() - start
                with self._lock:
                    if ok:
                        self.counts.publishes += 1
                    else:
                        self.counts.publish_failures += 1
                    self.counts.publish_s += took
                    self.counts.publish_max_s = max(self.counts.publish_max_s, took)
                if ok and "error" not in envelope.read_header(body):
                    self._keep(key, body)
            except Exception as exc:  # noqa: BLE001 - the lease lapses; the actor compiles it
                with self._lock:
                    self.counts.publish_failures += 1
                logger.warning("publishing a compiled grammar to the cache failed: %s", exc)
            finally:
                body = None
                _trim_heap()
        threading.Thread(target=run, name="grammar-publish", daemon=True).start()

    def _give_back(self, spec: GrammarSpec, key: str):
        """Hands the lease back (the actor compiles the grammar in its child process, under
        the limits) and waits for that result like any other asker."""
        with self._lock:
            self.counts.lease_releases += 1
        try:
            ray.get(self._handle().release.remote(self.fingerprint, key),
                    timeout=self.rpc_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the lease lapses on its own
            logger.warning("handing a grammar compile back to the cache failed: %s", exc)
        data = self._from_actor(spec, lease=False)
        if data is None:
            with self._lock:
                self.counts.local_fallbacks += 1
            return self._compile_in_child(spec, key)
        try:
            compiled = self._unpack(data, key)
        except envelope.CompileLocally:
            with self._lock:
                self.counts.verdicts += 1
            return self._compile_verdict(spec)
        except (envelope.Leased, envelope.EnvelopeMismatch):
            with self._lock:
                self.counts.local_fallbacks += 1
            return self._compile_in_child(spec, key)
        with self._lock:
            self.counts.actor_hits += 1
        self._keep(key, data)
        return compiled

    def _compile_verdict(self, spec: GrammarSpec):
        """In-process compile of a grammar the actor proved safe; see the module docstring
        for the bounds."""
        if not self._slot.acquire(blocking=False):
            # another in-process compile (maybe one past its limit) holds the slot
            with self._lock:
                self.counts.verdicts_in_child += 1
            return self._compile_in_child(spec, spec.key(self.fingerprint))
        _, done, box = self._compile_on_slot(spec, "grammar-verdict-compile")
        limit = self.config.compile_timeout_s
        if not done.wait(limit):
            with self._lock:
                self._stuck = not done.is_set()
            with self._lock:
                self.counts.verdict_timeouts += 1
            logger.warning("in-process compile of %s (proven to compile within the limit by "
                           "the grammar cache) passed %g s in this worker; failing the "
                           "request as unavailable, the compile runs on", spec.describe(),
                           limit)
            raise GrammarUnavailable(
                f"this {spec.kind} grammar did not compile within {limit:g} s on a busy "
                "worker (it is valid and compiles within the limit elsewhere); retry")
        if "error" in box:
            raise box["error"]
        return box["grammar"]

    def _compile_on_slot(self, spec: GrammarSpec, name: str):
        """Compiles ``spec`` in this process on a new daemon thread that owns the in-process
        slot (the caller has acquired it) and gives it back, clearing ``_stuck``, however
        the compile ends. Returns (thread, done, box): once ``done`` is set, ``box`` holds
        ``grammar`` and ``compile_s``, or ``error``. A caller that stops waiting leaves the
        thread running (xgrammar cannot stop a compile) and the slot taken until it ends."""
        done = threading.Event()
        box: dict = {}

        def run():
            try:
                t = time.perf_counter()
                box["grammar"] = compile_spec(self._compiler(), spec)
                box["compile_s"] = time.perf_counter() - t
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                box["error"] = exc
            finally:
                with self._lock:
                    self._stuck = False
                    self._slot.release()
                    done.set()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread, done, box

    def _compile_in_child(self, spec: GrammarSpec, key: str):
        result = self._local_pool().compile(spec, self.fingerprint, self._tokenizer_json, key)
        compiled = self._unpack(result.data, key)
        # compiled without the actor: the node keeps it anyway (as the actor would: a
        # verdict where loading it costs more than compiling it)
        if result.load_s >= self.config.local_verdict_factor * result.compile_s:
            self._keep(key, envelope.pack_local(self.fingerprint, key, result.compile_s))
        else:
            self._keep(key, result.data)
        return compiled

    def _compiler(self):
        with self._lock:
            if self._in_process is None:
                self._in_process = xgr.GrammarCompiler(self.info, max_threads=1,
                                                       cache_enabled=False)
            return self._in_process

    def _local_pool(self) -> CompilePool:
        with self._lock:
            if self._local is None:  # one process: it only serves while the actor is down
                self._local = CompilePool(self.config, processes=1)
            return self._local

    def _arm_warmup(self, delay: float) -> None:
        self._warm_timer = threading.Timer(delay, self._warm_local)
        self._warm_timer.name, self._warm_timer.daemon = "grammar-fallback-warmup", True
        self._warm_timer.start()

    def _warm_local(self) -> None:
        with self._lock:
            busy = self._fetching or time.monotonic() - self._last_fetch < FALLBACK_WARM_QUIET_S
        if self._closed or self._local is not None:
            return
        if busy:
            self._arm_warmup(FALLBACK_WARM_QUIET_S)
            return
        try:
            self._local_pool().wait_ready()
        except Exception:  # noqa: BLE001 - it will be started again on first use
            logger.exception("starting the fallback compile process")

    def close(self) -> None:
        """Stops the fallback compile process."""
        self._closed = True
        self._warm_timer.cancel()
        if self._local is not None:
            self._local.close()


class _Cancelled(Exception):
    """A call to the actor whose caller stopped waiting."""


def _get(ref, timeout: float, cancel: threading.Event | None):
    """``ray.get(ref, timeout)``, given up (``_Cancelled``) once ``cancel`` is set."""
    if cancel is None:
        return ray.get(ref, timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        ready, _ = ray.wait([ref], timeout=max(0.0, min(0.1, left)))
        if ready:
            return ray.get(ref)
        if cancel.is_set():
            raise _Cancelled
        if left <= 0:
            raise ray.exceptions.GetTimeoutError(f"no answer within {timeout:g} s")


def _grammar_bytes(compiled) -> int:
    try:
        return int(compiled.memory_size_bytes)
    except (AttributeError, TypeError):
        return 0


def _trim_heap() -> None:
    """Gives the heap's free memory back to the system. xgrammar's JSON writer takes about
    15x the JSON's size for a moment, its reader less, and glibc keeps what a thread freed
    in that thread's arena, so without a trim a worker grows by hundreds of MB for each big
    grammar it writes or loads. A trim costs milliseconds, on the fetch or publishing
    thread, never the step loop."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
