"""WorkerActor: one engine per Ray actor (one GPU each when the cluster has GPUs).

The actor owns an AsyncEngine. ``generate`` is an async generator, so Ray turns a call into
a streaming generator: the caller iterates object refs, one per output chunk, as they are
produced; tokens never pass through anyone else. A front end streams all its requests
on this worker through one ``channel`` instead (``submit`` starts each): one Ray item per
batch of requests, not per request (worker/channel.py). ``end_sessions`` takes a batch of session
ids (the scheduler's broadcast), ``abort`` stops one request, ``load`` reports what the
scheduler routes on, ``health`` answers when the engine loop is alive.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import socket
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import ray

# light at import: Ray imports this module wherever a worker handle is unpickled (the
# scheduler, every front end), so the engine (torch, transformers, xgrammar) is imported
# in __init__, in the worker's own process only
from grammar_cache.stats import (CheckStats, ClientStats, GrammarRequestStats,
                                 ReplicationStats)
from core.request import GenerationRequest

if TYPE_CHECKING:
    from grammar_cache.config import GrammarCacheConfig
    from worker.engine.config import EngineConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_REPORTED_FAMILIES = 2048  # about the grammars a worker's local LRU keeps
# a worker that had a request arrive this recently serves requests: a client's grammar
# checks get their compile share only (worker/guided/compile_meter.py)
SERVING_WINDOW_S = 5.0
MAX_REMEMBERED_CLIENTS = 1024


def grammar_report(client: dict | None, replication: dict | None, requests: dict,
                   checks: dict | None = None) -> dict:
    """The grammar group of ``load()`` (rendered by /metrics as
    ``rayguide_worker_grammar_client_<name>``): the cache client's counters, replication's,
    this worker's guided requests' and its grammar checks' and compile queue's
    (grammar_cache/stats.py); zeros for a part this worker does not run (no shared
    cache), so every series is always there."""
    return {**(client or ClientStats().as_dict()),
            **(replication or ReplicationStats().as_dict()), **requests,
            **(checks or CheckStats().as_dict())}


def served_model_name(model: str | None) -> str:
    """The name clients see (``/v1/models``): the default model's, or the last part of a
    path or hub id."""
    if not model:
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(model)).removesuffix(".gguf")


@ray.remote(max_restarts=-1)
class WorkerActor:
    def __init__(self, engine_config: EngineConfig | None = None, worker_id: str | None = None,
                 scheduler: tuple[str, str] | None = None,
                 grammar_cache: tuple[str, str, "GrammarCacheConfig"] | None = None):
        """engine_config: the engine's config, built once (ClusterConfig.engine) and passed
        as the object. scheduler: (name, namespace) of the scheduler actor to register with, at start
        and again whenever Ray restarts this actor. grammar_cache: (name, namespace,
        GrammarCacheConfig) of the shared cache actor to compile through (unless its
        ``shared`` is off) and whose limits bound this worker's own compiles; None: this
        worker compiles in child processes of its own under the default limits."""
        from grammar_cache.config import GrammarCacheConfig
        from worker.engine.async_engine import AsyncEngine
        from worker.engine.config import EngineConfig
        from worker.engine.engine import LLMEngine
        from worker.models import loader

        config = engine_config or EngineConfig()
        self.worker_id = worker_id or f"worker-{os.getpid()}"
        self.grammar_client = None
        self.replicator = None
        fetch = limits = None
        if grammar_cache is not None:
            limits = grammar_cache[2]  # its compile limits bound this worker's compiles too
            if limits.shared:
                fetch = self._cache_fetch(*grammar_cache)
        self.engine = AsyncEngine(LLMEngine(config, grammar_fetch=fetch,
                                            grammar_limits=limits or GrammarCacheConfig()))
        self.node_id = ray.get_runtime_context().get_node_id()
        self.device = config.device
        self.model_name = served_model_name(config.model)
        engine = self.engine.engine
        self.generation_defaults = (loader.generation_defaults(
            engine.model_dir) if engine.model_dir else {})
        self.started = time.time()
        # grammar families (GrammarSpec.family) this worker compiled or fetched, most recent
        # last: reported in load() for the scheduler's grammar-affinity routing. Families
        # served by llguidance (a compile of about a millisecond, in this worker) are
        # reported apart, as cheap: sending every request of a popular grammar to the one
        # worker that holds it would only pile them onto one batch
        self.families: OrderedDict[str, None] = OrderedDict()
        self.cheap_families: OrderedDict[str, None] = OrderedDict()
        # per guided request: did its grammar have to be fetched / compiled (a wait), and
        # for how long; the last ones kept for benchmarks (grammar_requests())
        self._grammar_counts = GrammarRequestStats()
        self._grammar_lock = threading.Lock()
        self._grammar_log: deque = deque(maxlen=8192)
        self._checks = None  # the grammar check's reports (built on first use)
        # client -> monotonic time of its last request's arrival (the newest last)
        self._arrivals: OrderedDict = OrderedDict()
        self._channels: dict = {}  # channel id -> worker.channel.Channel (front ends')
        if self.grammar_client is not None and grammar_cache is not None:
            self._start_replicator(*grammar_cache)
        # what the start built (Ray, torch, the tokenizer, the model, about half a million
        # objects) is kept out of the cyclic collector's full passes: each took 0.2 s of
        # the engine thread, a step 10x the median (bench/guided_host.py); what requests
        # make later is collected as before. Before registering: registration says the
        # worker is ready (a collection after it, seconds on a loaded machine, sent a
        # restarted worker's session elsewhere)
        gc.collect()
        gc.freeze()
        if scheduler is not None:
            try:
                handle = ray.get_actor(scheduler[0], namespace=scheduler[1])
                me = ray.get_runtime_context().current_actor
                handle.register.remote(self.worker_id, me, self.node_id, {
                    "model": self.model_name, "max_model_len": engine.max_model_len,
                    "generation_defaults": self.generation_defaults})
            except ValueError:
                pass  # no scheduler yet: it finds workers by name when it starts

    def _cache_fetch(self, name: str, namespace: str, config: "GrammarCacheConfig"):
        """The engine's grammar source: a factory the engine calls with its tokenizer
        info, giving the cache client's fetch (the engine itself knows no Ray)."""
        from grammar_cache.client import GrammarCacheClient

        def factory(info):
            self.grammar_client = GrammarCacheClient(
                info, config=config, name=name, namespace=namespace)
            return self.grammar_client.fetch
        return factory

    def _start_replicator(self, name: str, namespace: str,
                          config: "GrammarCacheConfig") -> None:
        """Warm replication (grammar_cache/replication.py): the task itself starts on the
        actor's event loop at the first async call (load, health, generate)."""
        from grammar_cache.replication import Replicator
        guided = self.engine.engine.guided
        if guided is None:
            return
        self.replicator = Replicator(
            config, guided.fingerprint,
            actor=lambda: ray.get_actor(name, namespace=namespace),
            prefetch=guided.get_grammar, holds=guided.holds,
            held_bytes=lambda: guided.cached_bytes,
            on_held=self._note_family,
            # requests waiting for their grammars go first (a list read: no lock needed)
            busy=lambda: bool(self.engine.engine.waiting_for_grammar),
            register=self.grammar_client.register)

    def _replicating(self) -> None:
        if self.replicator is not None:
            self.replicator.start()

    def _count_grammar_request(self, request: GenerationRequest) -> None:
        """Counts the request, and whether its grammar was ready here when it arrived; a
        wait is timed until the grammar is ready (the engine's ask joins this one)."""
        guided = self.engine.engine.guided
        spec = request.grammar
        if guided is None:
            return
        if self.replicator is not None:
            self.replicator.used(spec)
        entry = [request.request_id, spec.family, time.time(), False, 0.0]
        with self._grammar_lock:
            self._grammar_counts.grammar_requests += 1
            self._grammar_log.append(entry)
        if guided.holds(spec):
            return
        entry[3] = True
        t = time.monotonic()

        def done(_):
            wait = time.monotonic() - t
            entry[4] = wait
            with self._grammar_lock:
                c = self._grammar_counts
                c.grammar_request_waits += 1
                c.grammar_request_wait_s += wait
                c.grammar_request_wait_max_s = max(c.grammar_request_wait_max_s, wait)
        guided.get_grammar(spec, request.client).add_done_callback(done)

    def grammar_requests(self) -> list:
        """The last guided requests here: [request_id, family, arrival (epoch s), waited,
        wait_s]; what bench/grammar_cache.py computes its wait share from."""
        with self._grammar_lock:
            return [list(e) for e in self._grammar_log]

    async def generate(self, request: GenerationRequest):
        """Streams the request's RequestOutput chunks, each what it gained since the
        caller took the last; a bad request raises ValueError before the first chunk."""
        self._arrived(request)
        async for out in self.engine.generate(request):
            yield self._outgoing(request, out)

    async def submit(self, request: GenerationRequest, channel_id: str) -> None:
        """Starts a request whose chunks go out through the caller's channel
        ``channel_id`` (``channel``; worker/channel.py). A bad request raises ValueError
        and starts nothing."""
        self._arrived(request)
        stream = await self.engine.open(request)
        self._channel(channel_id).add(request, stream)

    async def channel(self, channel_id: str):
        """A streaming generator of the channel's batches: lists of chunks, one per
        request that gained output since the last list, for as long as the caller reads.
        When it ends (the caller gone), its requests still running are aborted."""
        channel = self._channel(channel_id)
        try:
            async for batch in channel.batches(self.engine.close):
                yield [self._outgoing(request, out) for request, out in batch]
        finally:
            self._channels.pop(channel_id, None)
            for rid in channel.request_ids():
                self.engine.close(rid)
                self.engine.abort(rid)

    def _channel(self, channel_id: str):
        from worker.channel import Channel
        if not isinstance(channel_id, str) or not channel_id:
            raise ValueError(f"channel_id must be a non-empty string, got {channel_id!r}")
        channel = self._channels.get(channel_id)
        if channel is None:
            channel = self._channels[channel_id] = Channel(channel_id)
        return channel

    def _arrived(self, request) -> None:
        if not isinstance(request, GenerationRequest):
            raise ValueError(f"generate takes a GenerationRequest, got {type(request).__name__}")
        self._replicating()
        self._arrivals[request.client] = time.monotonic()  # the newest last
        self._arrivals.move_to_end(request.client)
        while len(self._arrivals) > MAX_REMEMBERED_CLIENTS:
            self._arrivals.popitem(last=False)
        if request.grammar is not None:
            self._note_family(request.grammar)
            self._count_grammar_request(request)

    def _outgoing(self, request: GenerationRequest, out):
        """A chunk as it leaves the worker: who made it, and its tokens' texts when
        logprobs were asked for (only the worker has the vocabulary)."""
        if request.grammar is not None and out.finished:
            self._note_family(request.grammar)  # its engine is known by now
        out.worker_id = self.worker_id
        if out.logprobs:
            tokenizer = self.engine.engine.tokenizer
            # a token the engine forced to close the output early has no logprobs
            out.logprob_tokens = [
                [tokenizer.decode([tid]),
                 [tokenizer.decode([alt]) for alt, _ in (lp[1] if lp else ())]]
                for tid, lp in zip(out.token_ids, out.logprobs)]
        return out

    async def check_grammar(self, spec, client: str | None = None,
                            wait_s: float | None = None) -> dict:
        """The grammar check (worker/guided/grammar_check.py) on this worker's own compile
        path, so a request for ``spec`` that follows finds it compiled here (and, for
        xgrammar, in the shared cache); the report as a dict, built off the engine thread
        and kept per grammar (worker/guided/check_reports.py). A grammar error is part of
        the report; a transient failure (GrammarUnavailable: OVERLOADED when this
        worker's compile or report queue is full) is raised. ``wait_s``: how long to wait
        for the compile (default, and at most, the engine's ``grammar_timeout_s``); past
        it the report says "compiling" and the compile goes on, for the next check (or
        request) of the spec to find."""
        import asyncio

        reports = self._check_reports()
        self._replicating()
        limit = self.engine.engine.config.grammar_timeout_s
        wait_s = limit if wait_s is None else max(0.0, min(wait_s, limit))
        future, cached, began = reports.start(spec, client)
        if not future.done():
            try:  # shielded: the compile is not ours to cancel when the wait runs out
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), wait_s)
            except asyncio.TimeoutError:
                self._hold(spec.family)  # routing brings the next check here
                return reports.pending(spec, time.perf_counter() - began)
            except Exception:  # noqa: BLE001 - read off the future by the report
                pass
        waited = time.perf_counter() - began
        report = await asyncio.wrap_future(
            reports.report(spec, future, cached, waited, client))
        self._note_family(spec)  # routing sends the spec's requests where it is held
        return report

    def _check_reports(self):
        """The grammar check's reports (built on first use)."""
        from worker.guided.check_reports import CheckReports

        guided = self.engine.engine.guided
        if guided is None:
            raise ValueError("guided decoding is disabled on this worker (EngineConfig.guided)")
        if self._checks is None:
            self._checks = CheckReports(guided, busy=self._serving)
        return self._checks

    def _serving(self, client) -> bool:
        """Whether this worker serves requests of clients other than ``client`` now: one
        is open, or one arrived in the last ``SERVING_WINDOW_S`` (a client between its
        requests is still served). A client's own requests never count against its
        checks."""
        return (self.engine.serves_other_than(client)
                or arrived_since(self._arrivals, client, time.monotonic() - SERVING_WINDOW_S))

    def _hold(self, family: str) -> None:
        _remember(self.families, family)

    def _note_family(self, spec) -> None:
        """Held, or cheap when llguidance serves ``spec`` here (unknown before its first
        compile: held until then)."""
        guided = self.engine.engine.guided
        if guided is not None and guided.cheap(spec):
            self.families.pop(spec.family, None)
            _remember(self.cheap_families, spec.family)
        else:
            self._hold(spec.family)

    def end_sessions(self, session_ids: list[str]) -> int:
        for sid in session_ids:
            self.engine.end_session(sid)
        return len(session_ids)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def load(self) -> dict:
        self._replicating()
        stats = dataclasses.asdict(await self.engine.stats())
        stats.update(worker_id=self.worker_id, model=self.model_name, node_id=self.node_id,
                     device=self.device, host=socket.gethostname(), pid=os.getpid(),
                     max_model_len=self.engine.engine.max_model_len,
                     grammar_families=list(self.families),
                     cheap_grammar_families=list(self.cheap_families),
                     generation_defaults=self.generation_defaults,
                     uptime_s=time.time() - self.started,
                     grammar_client=self._grammar_stats())
        # the grammar checks queued here, which routing counts as queued tokens
        # (scheduler/routing.py: CHECK_COST_TOKENS each)
        checks = stats["grammar_client"]
        stats["checks_queued"] = checks["reports_waiting"] + checks["reports_running"]
        return stats

    def _grammar_stats(self) -> dict:
        with self._grammar_lock:
            requests = self._grammar_counts.as_dict()
        checks = self._checks.stats() if self._checks is not None else self._queue_stats()
        return grammar_report(
            self.grammar_client.stats() if self.grammar_client is not None else None,
            self.replicator.stats() if self.replicator is not None else None, requests,
            checks.as_dict())

    def _queue_stats(self) -> CheckStats:
        """CheckStats before the first check: the compile queue's part alone."""
        guided = self.engine.engine.guided
        if guided is None:
            return CheckStats()
        from worker.guided.check_reports import queue_stats
        return queue_stats(guided)

    async def health(self) -> bool:
        self._replicating()
        await self.engine.stats()  # answered by the engine thread: the loop is alive
        return True


def arrived_since(arrivals: OrderedDict, client, since: float) -> bool:
    """Whether a client other than ``client`` had a request arrive after ``since``
    (``arrivals``: client -> its last arrival, the newest last)."""
    for other, arrived in reversed(arrivals.items()):  # the newest first
        if arrived <= since:
            return False
        if other != client:
            return True
    return False


def _remember(families: OrderedDict, family: str) -> None:
    """Most recent last, at most MAX_REPORTED_FAMILIES."""
    families[family] = None
    families.move_to_end(family)
    while len(families) > MAX_REPORTED_FAMILIES:
        families.popitem(last=False)
