"""GuidedDecodingManager: the grammar store, the engine's one handle on its grammar engines
(xgrammar and llguidance behind worker/guided's backend protocol, chosen per grammar).

It owns the tokenizer info (built with the *model's* vocab size, so padded embedding rows
and ids the tokenizer lacks can never be sampled under a grammar, and with the model's
real EOS ids as stop tokens), compiles grammars off the step loop with a cache of
compiled grammars and of failures (bounded by bytes), and makes each guided request its own
matcher (``add_matcher``: the request's GuidedRequest owns it and hands it back with
``remove_matcher``; the manager counts the live ones). What a step does with the
matchers (the batch's token bitmask: fill, apply, UTF-8 bans) is its ``mask``, a
``MaskStage`` (mask_stage.py).

Which engine compiles a spec (``resolve``): the spec's ``engine`` when it names one, else
the manager's ``default_engine`` (``EngineConfig.grammar_engine``), and ``auto`` by the rule
in worker/guided/backend.py (llguidance for a JSON grammar it compiles, xgrammar elsewhere).

Where an xgrammar compile happens is pluggable: with ``fetch`` (for a worker in a cluster,
``GrammarCacheClient(info, ...).fetch``, injected by the worker actor: the engine imports
no Ray) through the shared cache actor; with ``compile_processes`` in this engine's own
``CompilePool`` (grammar_cache/compile_pool.py: killable child processes under the
grammar cache's time and memory limits); else in-process on the manager's thread pool
(xgrammar cannot stop a compile there: for tests and one-off use). llguidance grammars
always compile here: compiling one costs less than an actor round trip, and llguidance's
own limits bound it (worker/guided/llguidance_backend.py). The manager's cache is the worker's local LRU
of both, and of their errors.

Every compile waits in one bounded queue, shared fairly between clients (compile_queue.py
``FairQueue``, at most ``max_queued_compiles`` waiting, as the cache actor's): past it a new
grammar's future fails at once with GrammarUnavailable OVERLOADED (a 429), never queued.

A compile nobody waits for stops: a caller that waits (``get_grammar(..., waiter=True)``,
the engine's requests) calls ``give_up`` when it stops waiting (its grammar wait ran out,
it was aborted); when the last waiter of a compile gives up, the compile is cancelled (a
compile still queued never starts, one in a child process is killed at once, a fetch from
the cache actor is cancelled there) and the next ask for the spec starts a new one.

Why one module over 500 lines: the manager's compile paths, caches and matchers share one
lock and one set of counters; the libraries themselves live in worker/guided.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import xgrammar as xgr

from grammar_cache import envelope
from grammar_cache.compile import GrammarError, tokenizer_fingerprint
from grammar_cache.compile_pool import CompilePool
from grammar_cache.config import MAX_REPETITION, GrammarCacheConfig
from core.errors import ErrorKind, GrammarUnavailable
from core.grammar_spec import GrammarSpec
from worker.guided.closing import CompletionSearch
from worker.guided.compile_queue import FairQueue, QueueFull
from worker.guided.detokenizer import fast_encoder
from worker.guided.backend import (AUTO, BACKENDS, LLGUIDANCE, XGRAMMAR, CompiledGrammar,
                                   EngineRefused, GrammarBackend, GrammarMatcher,
                                   backend_order)
from worker.guided.llguidance_backend import LLGuidanceBackend
from worker.guided.mask_stage import MaskStage
from worker.guided.xgrammar_backend import XGrammarBackend
from worker.guided.xgrammar_backend import tokenizer_info as xgrammar_tokenizer_info

logger = logging.getLogger(__name__)

# fetch(spec, client): ``client`` is the asking request's GenerationRequest.client (an
# opaque string or None), for the shared cache's fair share of compiles between clients
GrammarFetch = Callable[[GrammarSpec, "str | None"], "xgr.CompiledGrammar"]
# what a worker injects: given the engine's tokenizer info, a fetch for compiled grammars
GrammarFetchFactory = Callable[["xgr.TokenizerInfo"], GrammarFetch]
_ERROR_BYTES = 1024  # what a cached failure counts against the byte bound


@dataclass
class GuidedStats:
    """The manager's counters (the worker's local grammar cache, per engine)."""

    hits: int = 0
    misses: int = 0
    compiles: int = 0  # grammars built or fetched here (both engines), and failures
    errors: int = 0
    evictions: int = 0
    xgrammar_grammars: int = 0  # grammars compiled (or fetched) per engine
    llguidance_grammars: int = 0
    xgrammar_requests: int = 0  # matchers created per engine (one per guided request)
    llguidance_requests: int = 0
    llguidance_refusals: int = 0  # auto: grammars llguidance refused, served by xgrammar
    cancelled: int = 0  # compiles stopped because their last waiter gave up
    overloaded: int = 0  # new grammars refused: the compile queue was full (OVERLOADED)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def count(self, backend: str, what: str) -> None:
        """One more of ``what`` ("grammars", "requests", "refusals") for ``backend`` (its
        name, as the metrics spell it; a field that does not exist raises)."""
        name = f"{backend}_{what}"
        setattr(self, name, getattr(self, name) + 1)


@dataclass(eq=False)
class _Inflight:
    """One compile in progress: its future, how many callers wait for it, and the event
    that cancels it once none does."""

    future: Future | None = None
    waiters: int = 0
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)


class GuidedDecodingManager:
    def __init__(self, tokenizer_info: "xgr.TokenizerInfo", *, max_batch_size: int = 64,
                 compile_threads: int = 1, fill_threads: int = 1, cache_bytes: int = 1 << 30,
                 error_ttl_s: float = GrammarCacheConfig.model_fields["error_ttl_s"].default,
                 fetch: GrammarFetch | None = None,
                 encode: Callable[[str], list[int]] | None = None,
                 llguidance: Callable[[], LLGuidanceBackend] | None = None,
                 default_engine: str = AUTO, max_repetition: int | None = None,
                 compile_processes: int = 0, compile_limits: GrammarCacheConfig | None = None):
        """``fetch``: compiles (or fetches) an xgrammar spec; None compiles here: in
        ``compile_processes`` child processes under ``compile_limits`` (a
        GrammarCacheConfig: compile_timeout_s, compile_memory_mb, max_repetition), or with
        0 on ``compile_threads`` threads of this process. ``encode``: the tokenizer's text
        -> ids, used to cost forced strings in closing searches. ``llguidance``: builds the
        llguidance engine (on first use; None: no llguidance here, ``auto`` is xgrammar).
        ``default_engine``: what a spec whose engine is ``auto`` gets (``auto``: the rule).
        ``max_repetition``: the repetition limit (default: ``compile_limits``'), applied to
        llguidance compiles as the cache applies it to xgrammar's."""
        if default_engine not in (AUTO, *BACKENDS):
            raise ValueError(f"grammar engine {default_engine!r} is not one of "
                             f"{(AUTO, *BACKENDS)}")
        self.tokenizer_info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        self.stop_token_ids = list(tokenizer_info.stop_token_ids)
        self.fingerprint = tokenizer_fingerprint(tokenizer_info)
        self._live: set[GrammarMatcher] = set()  # the requests' matchers (add_matcher)
        self._grammars: OrderedDict[str, object] = OrderedDict()  # key -> compiled | error
        self._sizes: dict[str, int] = {}  # key -> bytes it counts against cache_bytes
        self.cached_bytes = 0
        self._error_time: dict[str, float] = {}
        self._inflight: dict[str, _Inflight] = {}
        self._lock = threading.Lock()
        self.compile_limits = compile_limits or GrammarCacheConfig()
        # xgrammar compiles of this engine's own: killable child processes, or threads
        self.compile_pool: CompilePool | None = None
        if fetch is None and compile_processes:
            self.compile_pool = CompilePool(self.compile_limits, processes=compile_processes,
                                            start=1)
            self._tokenizer_json = tokenizer_info.serialize_json()
        # with a remote fetch or child processes the threads mostly wait: several, so one
        # slow compile does not hold every other new grammar behind it
        waits = fetch is not None or self.compile_pool is not None
        # every compile of this manager waits in a bounded queue, fair between clients
        # (compile_queue.py); past its bound a new grammar is OVERLOADED at once. Builds in
        # this process (llguidance's: this CPU, the engine's interpreter) have a queue of
        # their own, on ``compile_threads``, so a flood of them never runs eight at a time
        limit = self.compile_limits.max_queued_compiles
        self.queue = FairQueue(8 if waits else compile_threads, limit, "grammar-compile")
        self.build_queue = FairQueue(compile_threads, limit, "grammar-build")
        # the backends by name; the others' factories, built on first use (llguidance's
        # takes about half a second)
        xgrammar = XGrammarBackend(tokenizer_info, compile_threads=compile_threads,
                                   fetch=self._xgrammar_artifact)
        self._backends: dict[str, GrammarBackend] = {XGRAMMAR: xgrammar}
        self._fetch = fetch or (lambda spec, _client: xgrammar.build(spec))
        # a fetch that takes ``cancel`` (GrammarCacheClient.fetch) stops waiting for the
        # cache actor once nobody waits for the grammar here
        self._fetch_cancels = fetch is not None and "cancel" in inspect.signature(
            fetch).parameters
        self._factories: dict[str, Callable[[], GrammarBackend]] = (
            {LLGUIDANCE: llguidance} if llguidance is not None else {})
        self._backends_lock = threading.Lock()
        self.cache_bytes = cache_bytes
        self.error_ttl_s = error_ttl_s
        self.stats = GuidedStats()
        self.default_engine = default_engine
        self.max_repetition = (self.compile_limits.max_repetition if max_repetition is None
                               else max_repetition)
        self._encode = encode
        self._closer: CompletionSearch | None = None
        # the batch's mask (mask_stage.py): what a step does with the matchers made here
        self.mask = MaskStage(self.vocab_size, self.stop_token_ids, max_batch_size,
                              backend=self.backend, closer=lambda: self.closer,
                              fill_threads=fill_threads)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: list[int], *,
                       grammar_fetch: GrammarFetchFactory | None = None, **kwargs):
        """The manager for a Hugging Face tokenizer. ``grammar_fetch(info)`` returns the
        function that compiles or fetches a spec (a worker passes
        ``lambda info: GrammarCacheClient(info, ...).fetch``); None compiles in-process."""
        info = xgrammar_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        if grammar_fetch is not None:
            kwargs["fetch"] = grammar_fetch(info)
        # closing paths' texts, a few a step near a budget: 330 us a call through transformers
        kwargs.setdefault("encode", fast_encoder(tokenizer))
        kwargs.setdefault("llguidance", lambda: LLGuidanceBackend.from_huggingface(
            tokenizer, vocab_size, stop_token_ids))
        return cls(info, **kwargs)

    @property
    def closer(self) -> CompletionSearch:
        """The shortest-completion search (built on first use: it reads the vocabulary)."""
        if self._closer is None:
            self._closer = CompletionSearch(self.tokenizer_info, self._encode)
        return self._closer

    # grammars ---------------------------------------------------------------------------

    def get_grammar(self, spec: GrammarSpec, client: str | None = None, *,
                    waiter: bool = False) -> Future:
        """A future of the CompiledGrammar (or of the GrammarError; EngineRefused names
        the engine). Cached grammars and cached failures resolve at once; concurrent asks
        for one spec share one compile, fetched for the ``client`` (the request's
        GenerationRequest.client) of the ask that started it. ``waiter``: the caller
        waits for it and calls ``give_up(spec, future)`` if it stops waiting before the
        future is done (the compile stops once no waiter is left)."""
        key = spec.key(self.fingerprint)
        with self._lock:
            cached = self._grammars.get(key)
            if cached is not None and not self._expired(key):
                self._grammars.move_to_end(key)
                self.stats.hits += 1
                fut: Future = Future()
                if isinstance(cached, GrammarError):
                    fut.set_exception(cached)
                else:
                    fut.set_result(cached)
                return fut
            running = self._inflight.get(key)
            if running is not None:
                self.stats.hits += 1
                running.waiters += waiter
                return running.future
            self.stats.misses += 1
            running = self._inflight[key] = _Inflight(Future(), waiters=int(waiter))
        try:  # outside the lock: a displaced compile's refusal takes it
            self._queue_for(spec).submit(client, running.future,
                                         lambda: self._compile(key, spec, client, running),
                                         lambda: self._overloaded(key, spec, running))
        except QueueFull:
            self._overloaded(key, spec, running)
        return running.future

    def _queue_for(self, spec: GrammarSpec) -> FairQueue:
        """``build_queue`` when the first backend to try ``spec`` compiles in this process,
        else ``queue``."""
        first = backend_order(spec, self.default_engine, llguidance=self.has(LLGUIDANCE))[0]
        built = self._backends.get(first)
        # (a backend not built yet comes from a factory: llguidance's, which builds here)
        return self.build_queue if built is None or built.compiles_locally else self.queue

    @property
    def queues(self) -> tuple[FairQueue, FairQueue]:
        """The compile queues: (remote or child-process compiles, builds in this process)."""
        return self.queue, self.build_queue

    def _overloaded(self, key: str, spec: GrammarSpec, running: _Inflight) -> None:
        """``running``'s compile was refused a place in the queue (or gave its place to a
        lighter client's): its askers get OVERLOADED (429, retry), nothing is cached."""
        with self._lock:
            self._forget(key, running)
            self.stats.overloaded += 1
            waiting = self.queue.waiting + self.build_queue.waiting
        if not running.future.done():
            running.future.set_exception(GrammarUnavailable(
                f"this worker has {waiting} grammar compiles waiting (the limit is "
                f"{self.queue.limit} a queue: grammar_cache.max_queued_compiles) and this client "
                f"has its share of them; this new {spec.kind} grammar was not queued: retry "
                "in a few seconds", ErrorKind.OVERLOADED))

    def give_up(self, spec: GrammarSpec, future: Future) -> None:
        """A waiter of ``future`` (``get_grammar(..., waiter=True)``) stopped waiting for
        it. The last one to do so cancels the compile (see the module docstring)."""
        key = spec.key(self.fingerprint)
        with self._lock:
            running = self._inflight.get(key)
            if running is None or running.future is not future or future.done():
                return
            running.waiters -= 1
            if running.waiters > 0:
                return
            running.cancel.set()
            del self._inflight[key]  # the next ask starts a compile of its own
            self.stats.cancelled += 1
        if any(q.drop(future) for q in self.queues):  # still queued: it never starts
            future.set_exception(GrammarUnavailable(
                f"the compile of this {spec.kind} grammar was cancelled (nobody waits for "
                "it any more); retry"))
        logger.info("cancelled the compile of %s: nobody waits for it any more",
                    spec.describe())

    def holds(self, spec: GrammarSpec) -> bool:
        """Whether ``spec``'s compiled grammar is ready here (a request for it would not
        wait); for the worker's replication and its per-request wait counters."""
        with self._lock:
            cached = self._grammars.get(spec.key(self.fingerprint))
            return cached is not None and not isinstance(cached, GrammarError)

    def cheap(self, spec: GrammarSpec) -> bool:
        """Whether ``spec``'s grammar here is one its backend compiles in this process in
        about a millisecond (llguidance's, ``auto`` resolved: ``compiles_locally``), so
        another worker gains next to nothing by sending its requests here (False before
        its compile ends, or when it failed)."""
        with self._lock:
            cached = self._grammars.get(spec.key(self.fingerprint))
        return (isinstance(cached, CompiledGrammar)
                and self.backend(cached.engine).compiles_locally)

    def held_bytes(self, spec: GrammarSpec) -> int | None:
        """What ``spec``'s cached grammar counts against ``cache_bytes`` (xgrammar: its own
        memory estimate; llguidance: a guess), None when it is not cached here."""
        with self._lock:
            return self._sizes.get(spec.key(self.fingerprint))

    def llguidance_refusal(self, spec: GrammarSpec) -> GrammarError | None:
        """What llguidance says of ``spec`` as ``_build`` would ask it (the cache's
        repetition limit first): its refusal, or None when it compiles (for the grammar
        check, whatever backend serves the spec; an ``EngineRefused`` when this manager
        has no llguidance)."""
        try:
            ll = self.backend(LLGUIDANCE)
            spec.check_repetitions(self.max_repetition)
            ll.compile(spec)
        except ValueError as exc:  # GrammarError, or a ValueError of llguidance's own
            return exc if isinstance(exc, GrammarError) else EngineRefused(LLGUIDANCE, str(exc))
        return None

    def resolve(self, spec: GrammarSpec) -> str:
        """The engine asked for ``spec``: its own, else the default (maybe ``auto``)."""
        return spec.engine if spec.engine != AUTO else self.default_engine

    def backend(self, name: str) -> GrammarBackend:
        """The backend called ``name`` (built on first use); EngineRefused when this
        manager has none of that name."""
        backend = self._backends.get(name)
        if backend is None:
            factory = self._factories.get(name)
            if factory is None:  # (xgrammar is always here)
                raise EngineRefused(name, f"{name} is not available in this engine; use "
                                    "grammar engine 'xgrammar' or 'auto'")
            with self._backends_lock:
                backend = self._backends.get(name)
                if backend is None:
                    backend = self._backends[name] = factory()
        return backend

    def has(self, name: str) -> bool:
        """Whether this manager has a backend called ``name``."""
        return name in self._backends or name in self._factories

    def _build(self, spec: GrammarSpec, client: str | None = None,
               cancel: threading.Event | None = None) -> CompiledGrammar:
        """Compiles ``spec`` on the backends ``backend_order`` names, the first that takes
        it; raises GrammarError (GrammarUnavailable once ``cancel`` is set)."""
        order = backend_order(spec, self.default_engine, llguidance=self.has(LLGUIDANCE))
        refusals: dict[str, EngineRefused] = {}
        for name in order:
            backend = self.backend(name)
            try:
                if backend.compiles_locally:  # the cache's limit, as the cache applies it
                    spec.check_repetitions(self.max_repetition)
                compiled = backend.compile(spec, client=client, cancel=cancel)
            except EngineRefused as exc:
                if name == order[-1]:
                    raise
                self.stats.count(name, "refusals")  # auto: served by the next backend
                refusals[name] = exc
                continue
            self.stats.count(name, "grammars")
            # the grammar check reports them without compiling the spec again there
            compiled.facts.refusals = refusals
            return compiled
        raise AssertionError("unreachable: the last backend's refusal is raised")

    def _xgrammar_artifact(self, spec: GrammarSpec, client: str | None,
                           cancel: threading.Event | None):
        """Where this worker's xgrammar grammars come from: the fetch (the shared cache in
        a cluster, under the request's key, which the cache's hot lists and replication
        count by), this engine's compile processes, or this thread; raises GrammarError."""
        if self.compile_pool is not None:
            return self._compile_in_child(spec, cancel)
        if self._fetch_cancels:
            return self._fetch(spec, client, cancel=cancel)
        return self._fetch(spec, client)

    def _compile_in_child(self, spec: GrammarSpec, cancel: threading.Event | None):
        """xgrammar's compile in this engine's CompilePool: killed past its limits or
        once ``cancel`` is set (then GrammarUnavailable; a limit is a GrammarError)."""
        key = spec.key(self.fingerprint)
        result = self.compile_pool.compile(spec, self.fingerprint, self._tokenizer_json, key,
                                           cancel=cancel)
        return envelope.unpack(result.data, self.tokenizer_info, self.fingerprint, key)

    def _compile(self, key: str, spec: GrammarSpec, client: str | None, running: _Inflight):
        t, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._compile_job(key, spec, client, running, t)
        finally:  # this process's CPU for it (a compile in the cache actor or a child
            # process costs here only the wait), read by the grammar check's CompileMeter
            running.future.cost_s = time.thread_time() - cpu

    def _compile_job(self, key: str, spec: GrammarSpec, client: str | None,
                     running: _Inflight, t: float):
        try:
            if running.cancel.is_set():  # every waiter gave up while it was queued
                raise GrammarUnavailable(f"the compile of this {spec.kind} grammar was "
                                         "cancelled (nobody waits for it any more); retry")
            result = self._build(spec, client, running.cancel)
        except GrammarError as exc:
            result = exc
        except BaseException:
            # not the grammar's fault (the compile service failed, or it was cancelled):
            # fail this wait, and let the next request for the spec try again instead of
            # joining a dead future
            with self._lock:
                self._forget(key, running)
            raise
        with self._lock:
            self._forget(key, running)
            self.stats.compiles += 1
            self._store(key, result)
        logger.debug("compiled %s in %.1f ms", spec.describe(), 1e3 * (time.perf_counter() - t))
        if isinstance(result, GrammarError):
            raise result
        return result

    def _forget(self, key: str, running: _Inflight) -> None:
        """Drops ``running`` from the compiles in progress (unless a newer compile of the
        key took its place after it was cancelled)."""
        if self._inflight.get(key) is running:
            del self._inflight[key]

    def _store(self, key: str, result) -> None:
        """Caches a compiled grammar or a failure; evicts least recently used entries
        while the cache holds more than ``cache_bytes`` (the newest always stays)."""
        if isinstance(result, GrammarError):
            self.stats.errors += 1
            self._error_time[key] = time.monotonic()
            size = _ERROR_BYTES
        else:
            size = self.backend(result.engine).grammar_bytes(result)
        self.cached_bytes -= self._sizes.get(key, 0)
        self._grammars[key] = result
        self._grammars.move_to_end(key)
        self._sizes[key] = size
        self.cached_bytes += size
        while self.cached_bytes > self.cache_bytes and len(self._grammars) > 1:
            old, _ = self._grammars.popitem(last=False)
            self._error_time.pop(old, None)
            self.cached_bytes -= self._sizes.pop(old, 0)
            self.stats.evictions += 1

    def _expired(self, key: str) -> bool:
        t = self._error_time.get(key)
        return t is not None and time.monotonic() - t > self.error_ttl_s

    # matchers ---------------------------------------------------------------------------

    def add_matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher for one request (its GuidedRequest owns it: no other request
        can reach it), counted per engine and live until ``remove_matcher``."""
        matcher = self.new_matcher(compiled)
        self.stats.count(compiled.engine, "requests")
        self._live.add(matcher)
        return matcher

    def new_matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A matcher at the start of ``compiled`` (not registered: for checks and tests)."""
        return self.backend(compiled.engine).matcher(compiled)

    def remove_matcher(self, matcher: GrammarMatcher) -> None:
        """A request's matcher is no longer needed (its request ended)."""
        self._live.discard(matcher)

    @property
    def num_matchers(self) -> int:
        """The requests' matchers alive (added, not yet removed)."""
        return len(self._live)

    def shutdown(self) -> None:
        """Stops the compile threads (a compile in progress finishes on its own) and the
        compile processes."""
        with self._lock:
            for running in self._inflight.values():
                running.cancel.set()
        for future in self.queue.close() + self.build_queue.close():
            if not future.done():
                future.set_exception(GrammarUnavailable("the engine is shutting down"))
        if self.compile_pool is not None:
            self.compile_pool.close()
