"""GrammarCacheActor: compiles each grammar once per cluster and hands out the result.

An async Ray actor, named so any process of the cluster finds it (detached when the
runtime runs as a service). Workers register their tokenizer once (xgrammar's TokenizerInfo
serialization, keyed by its fingerprint); ``get(spec, fingerprint)`` returns envelope bytes
(grammar_cache/envelope.py): the compiled grammar or the error. Concurrent asks for one key
wait on the same compile; compiles run in a CompilePool (killable child processes, time and
memory limits); results live in a byte-bounded LRU, errors in a small cache with a shorter
lifetime. When xgrammar's serialization of a grammar loads slower than the grammar
compiles (large token-mask tables), the cache keeps a small "compile locally" verdict
instead: the grammar is proven safe, and workers compile it in-process. Stats are exported
as Ray metrics.

Readiness is explicit: the actor answers ``ping`` as soon as its process is up, and
``ready()`` once its compile processes have finished their imports (seconds, more on a
loaded machine). Callers that need the cache wait on ``wait_ready(actor)``; a ``get`` that
arrives earlier simply waits for the first free compile process.

Transient failures (a compile process that died) are passed on to the asker and never
cached: the next ask compiles again.

Leases: a worker that asks for a grammar nobody has compiled may offer to compile it itself
(``get(..., lease=True)``, for grammars its client judges ordinary). It gets a lease
envelope, compiles in-process, answers its request, and publishes the result
(``publish``) from a background thread; other askers wait for that publication as they
would for a compile here. A worker that gives up (its compile passed the limit) calls
``release`` and the compile runs here, in the killable child processes, as it does for a
lease that lapses (its holder died). A lease counts as the grammar's compile.

The disk tier (grammar_cache/disk.py): a miss looks on this node's disk before compiling,
and every compiled grammar is written there, so a restarted actor (or cluster) compiles
nothing it compiled before.

Warm replication: workers report how often each grammar was requested (``hot(fp, cursor,
uses)``, every second or so, from their background replicator); a grammar requested
``replicate_after_requests`` times anywhere in the cluster, or listed in ``hot_specs``,
joins the tokenizer's hot list, and every worker fetches what it lacks of that list in the
background, so a request that meets a known grammar on another worker finds it there.
What the hot lists remember is bounded (grammar_cache/hot_list.py): a grammar nobody asked
for in a while, or past ``max_tracked_grammars``, is forgotten and leaves its hot list.

Why one module over 500 lines: the actor's queue, leases, in-flight waits and caches share
one event loop and one set of counters; split, each part would reach into the others' state.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

import ray
from ray.util import metrics

from grammar_cache import disk as disk_tier
from grammar_cache import envelope
from grammar_cache.compile_pool import WALL_FACTOR, CompilePool, CompileResult
from grammar_cache.checked import CheckedGrammars
from grammar_cache.config import GrammarCacheConfig
from core.errors import ErrorKind, GrammarError
from core.fair_lines import FairLines
from grammar_cache.hot_list import HotList
from core.percentile import percentile
from core.grammar_spec import GrammarSpec
from core.response_store import ResponseStore
from grammar_cache.stats import CacheStats

__all__ = ["ACTOR_NAME", "NAMESPACE", "GrammarCache", "GrammarCacheActor", "GrammarCacheConfig",
           "get_or_create_actor", "wait_ready"]

logger = logging.getLogger(__name__)

ACTOR_NAME = "rayguide_grammar_cache"
# a lease holder's allowance for serializing and sending what it compiled (tens of MB of
# JSON: seconds on a busy machine)
LEASE_SERIALIZE_S = 60.0
NAMESPACE = "rayguide"


class _ByteLRU:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self.evictions = 0

    def get(self, key: str) -> bytes | None:
        data = self._items.get(key)
        if data is not None:
            self._items.move_to_end(key)
        return data

    def put(self, key: str, data: bytes) -> None:
        if key in self._items:
            self.bytes -= len(self._items.pop(key))
        if len(data) > self.max_bytes:
            return  # larger than the whole budget: serve it, don't keep it
        self._items[key] = data
        self.bytes += len(data)
        while self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= len(old)
            self.evictions += 1

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


class QueueFull(Exception):
    """The compile queue is full and the asking client already has its share of it (or a
    client with a smaller share took this compile's place)."""


class CompileQueue:
    """The actor's compile slots (one per compile process), shared fairly between clients.

    A compile that finds no free slot waits in its client's line; a freed slot goes to the
    head of the next line in turn (round robin, first between tenants, then between a
    tenant's clients: core/fair_lines.py), so a client with fifty compiles waiting holds
    another client's one back by one compile at most, and a tenant with fifty clients
    another tenant's one by one at most. At most ``limit`` compiles wait: past it, a
    client of a tenant with fewer waiting than the tenant with the most takes the place of
    that tenant's heaviest client's newest compile (which fails with QueueFull), as does a
    client with fewer than the heaviest of its own tenant's, and any other is refused with
    QueueFull. Without client identities (``client`` None for all) it is one bounded
    first-come line. Runs on the actor's event loop; not thread-safe."""

    def __init__(self, slots: int, limit: int):
        self.free = slots
        self.limit = limit
        self.lines = FairLines()

    @property
    def waiting(self) -> int:
        return self.lines.waiting

    def enter(self, client=None, force: bool = False) -> asyncio.Future:
        """A place in ``client``'s line: a future that resolves when a slot is its own (at
        once when one is free), or fails with QueueFull when it was displaced. Raises
        QueueFull when the queue is full and the client has its share; ``force``: never
        refused (a compile someone was promised: a lease given back)."""
        ticket = asyncio.get_running_loop().create_future()
        if self.free and not self.waiting:
            self.free -= 1
            ticket.set_result(None)
            return ticket
        if self.waiting >= self.limit and not force:
            found = self.lines.victim_for(client)
            if found is None:
                raise QueueFull()
            victim = self._remove(*found)
            if not victim.done():
                victim.set_exception(QueueFull())
        self.lines.add(client, ticket)
        return ticket

    def leave(self, client, ticket: asyncio.Future) -> None:
        """The compile that holds ``ticket`` is over (done or cancelled): its slot, or its
        place in the line, goes to the next."""
        if self.lines.holds(client, ticket):  # still waiting (or cancelled waiting)
            self._remove(client, ticket).cancel()
        elif ticket.done() and not ticket.cancelled() and ticket.exception() is None:
            self._next()  # it held a slot

    def _remove(self, client, ticket: asyncio.Future) -> asyncio.Future:
        self.lines.remove(client, ticket)
        return ticket

    def _next(self) -> None:
        while self.lines:
            _, ticket = self.lines.pop()  # its client's next waits for the others' turn
            if not ticket.done():  # (a cancelled one is on its way out: skip it)
                ticket.set_result(None)
                return
        self.free += 1


class GrammarCache:
    """The actor's logic, usable without Ray (the actor class below wraps it)."""

    def __init__(self, config: GrammarCacheConfig | None = None):
        self.config = config = config or GrammarCacheConfig()
        # one compile process starts with the actor, the others when compiles overlap
        self.pool = CompilePool(config, start=1)
        # Own threads, never the event loop's default executor: a compile waiting for a free
        # process holds its thread, and with the default pool's few threads queued compiles
        # kept a finished compile's disk write (and so its reply) waiting behind them. Here a
        # compile takes a thread only once it holds one of the pool's slots, and disk work
        # has threads of its own.
        self._compile_threads = ThreadPoolExecutor(config.compile_processes,
                                                   thread_name_prefix="grammar-compile")
        self.queue = CompileQueue(config.compile_processes, config.max_queued_compiles)
        self._disk_threads = ThreadPoolExecutor(2, thread_name_prefix="grammar-disk")
        self.tokenizers: dict[str, str] = {}
        self.lru = _ByteLRU(config.max_bytes)
        self.errors: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self.inflight: dict[str, asyncio.Future] = {}
        # key -> the task compiling it for askers of get(), and how many of them still wait
        # (none left: the compile is cancelled)
        self._compiles: dict[str, asyncio.Task] = {}
        self._waiters: dict[str, int] = {}
        # key -> (spec, fingerprint, lapse timer) of grammars a worker is compiling
        self.leases: dict[str, tuple[GrammarSpec, str, asyncio.TimerHandle]] = {}
        self._tasks: set[asyncio.Task] = set()
        self.compiling = 0  # compiles running or waiting for a compile process
        self.compile_times: deque[float] = deque(maxlen=2048)
        self.counts = CacheStats()
        self.disk = disk_tier.from_config(config)
        # keys ever asked for (bounded: how the cluster's compiles per distinct grammar is
        # computed); specs and requests per key reported by workers, and the hot lists
        self.distinct: OrderedDict[str, None] = OrderedDict()
        self.hot_list = HotList(config)
        self.checked = CheckedGrammars()  # POST /v1/grammars' reports, by owner and id
        # POST /v1/responses' stored conversations, by owner (tenant) and id: every front
        # end's previous_response_id finds them
        self.responses = ResponseStore(config.responses_ttl_s, config.responses_max_stored,
                                       config.responses_max_stored_chars)
        self._ready = threading.Event()
        self._ready_error: str | None = None
        threading.Thread(target=self._start_pool, name="grammar-pool-start",
                         daemon=True).start()
        tags = ("kind",)
        self._m_requests = metrics.Counter("rayguide_grammar_cache_requests",
                                           "grammar cache lookups", tag_keys=("result",))
        self._m_compile = metrics.Histogram(
            "rayguide_grammar_compile_seconds", "grammar compile time",
            boundaries=[0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30], tag_keys=tags)
        self._m_bytes = metrics.Gauge("rayguide_grammar_cache_bytes", "bytes of cached grammars")

    def _start_pool(self) -> None:
        try:
            self.pool.wait_ready()
        except Exception as exc:  # noqa: BLE001 - reported by ready(), and compiles retry
            self._ready_error = str(exc)
            logger.exception("starting the grammar compile processes")
        self._ready.set()

    async def ready(self, timeout_s: float | None = None) -> bool:
        """True once the compile processes are up (waits up to ``timeout_s``, default the
        config's ready_timeout_s); raises RuntimeError if they failed to start."""
        timeout = self.config.ready_timeout_s if timeout_s is None else timeout_s
        if not self._ready.is_set():
            await asyncio.to_thread(self._ready.wait, timeout)
        if self._ready_error is not None:
            raise RuntimeError(f"the grammar cache's compile processes did not start: "
                               f"{self._ready_error}")
        return self._ready.is_set()

    def register_tokenizer(self, fingerprint: str, tokenizer_json: str) -> None:
        self.tokenizers[fingerprint] = tokenizer_json
        for spec in self.config.hot_grammar_specs():  # configured hot: warm everywhere
            self._mark_hot(spec, fingerprint)

    # warm replication ----------------------------------------------------------------

    def _mark_hot(self, spec: GrammarSpec, fingerprint: str) -> None:
        if self.hot_list.pin(fingerprint, spec.key(fingerprint), spec):
            self.counts.hot += 1

    def hot(self, fingerprint: str, since: int = 0,
            uses: list[tuple[str, int, GrammarSpec | None]] = ()) -> dict:
        """Takes a worker's report of requests per grammar since its last call (``uses``:
        (key, requests, spec or None when sent before)) and answers with
        - ``cursor`` and ``specs``: the tokenizer's hot grammars added since ``since`` (the
          cursor of the last call; 0 for a new worker, which gets every hot grammar, most
          requested first), without those known to fail;
        - ``compiling``: compiles running or queued here now (requests wait for those:
          workers hold their prefetches back meanwhile);
        - ``known``: whether this cache has the tokenizer (a worker that has made no request
          yet registers it then, so configured hot grammars warm before any request)."""
        for key, n, spec in uses:
            if self.hot_list.use(fingerprint, key, n, spec):
                self.counts.hot += 1
        cursor, new = self.hot_list.since(fingerprint, since)
        return {"cursor": cursor, "compiling": self.compiling + len(self.leases),
                "specs": [s for k, s in new if self._cached_error(k) is None],
                "known": fingerprint in self.tokenizers}
    def has_tokenizer(self, fingerprint: str) -> bool:
        return fingerprint in self.tokenizers

    async def get(self, spec: GrammarSpec, fingerprint: str, lease: bool = False,
                  client: str | None = None) -> bytes | None:
        """Envelope bytes for the spec; None means: this cache does not know the tokenizer
        (it restarted), register it and ask again. ``lease``: the asker offers to compile a
        grammar nobody has compiled yet; it then gets a lease envelope (see the module
        docstring) instead of waiting for a compile here. ``client``: who the request is
        for (compile slots are shared fairly between clients: see CompileQueue).

        Refused at once, without a compile: a grammar with a repetition over
        ``max_repetition`` (grammar_too_large), and a new grammar while the compile queue
        is full (overloaded; never cached). A compile every asker has left (their calls were
        cancelled) is cancelled: dropped from the queue, or its compile process killed."""
        if fingerprint not in self.tokenizers:
            return None
        key = spec.key(fingerprint)  # cached on the spec by whoever built it
        data = self.lru.get(key) or self._cached_error(key)
        if data is not None:
            self.counts.hits += 1
            self._m_requests.inc(tags={"result": "hits"})
            self._seen(key, spec)
            return data
        try:  # microseconds; not remembered, so refused grammars take no memory here
            spec.check_repetitions(self.config.max_repetition)
        except GrammarError as exc:
            self.counts.too_large += 1
            self._m_requests.inc(tags={"result": "too_large"})
            return envelope.pack_error(str(exc), fingerprint, key, exc.kind)
        self._seen(key, spec)
        if key in self.inflight:
            self.counts.joined += 1
            self._m_requests.inc(tags={"result": "joined"})
            return await self._wait(key)
        self.counts.misses += 1
        self._m_requests.inc(tags={"result": "misses"})
        self.inflight[key] = asyncio.get_running_loop().create_future()
        try:
            data = await self._from_disk(fingerprint, key)
        except BaseException as exc:
            self._fail(key, exc)
            raise
        if data is None and lease and fingerprint in self.tokenizers:
            self._grant(spec, fingerprint, key)  # in flight until the holder publishes
            return envelope.pack_lease(fingerprint, key)
        if data is not None:
            self._settle(key, data)
            return data
        try:
            ticket = self.queue.enter(client)
        except QueueFull:
            data = self._overloaded(spec, fingerprint, key)
            self._settle(key, data)  # for whoever joined meanwhile; never cached
            return data
        task = asyncio.get_running_loop().create_task(
            self._compile_for_askers(spec, fingerprint, key, client, ticket))
        self._compiles[key] = task
        return await self._wait(key)

    def _seen(self, key: str, spec: GrammarSpec) -> None:
        self.hot_list.seen(key, spec)
        self.distinct[key] = None
        self.distinct.move_to_end(key)
        while len(self.distinct) > 100_000:
            self.distinct.popitem(last=False)

    async def _wait(self, key: str) -> bytes:
        """The in-flight result for ``key``; an asker whose call is cancelled leaves, and
        the last to leave cancels the compile (a lease's compile is the holder's: kept)."""
        fut = self.inflight[key]
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            return await asyncio.shield(fut)
        finally:
            left = self._waiters.pop(key) - 1
            if left:
                self._waiters[key] = left
            elif not fut.done() and key in self._compiles:
                self._compiles[key].cancel()

    async def _compile_for_askers(self, spec: GrammarSpec, fingerprint: str, key: str,
                                  client, ticket: asyncio.Future) -> None:
        try:
            data = await self._compile(spec, fingerprint, key, client, ticket)
        except QueueFull:  # a client with a smaller share took its place
            self.counts.displaced += 1
            data = self._overloaded(spec, fingerprint, key)
        except asyncio.CancelledError:
            self.counts.cancelled += 1
            logger.info("compile of %s cancelled: nobody waits for it", spec.describe())
            self._fail(key, asyncio.CancelledError())
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the askers
            self._fail(key, exc)
            return
        finally:
            self._compiles.pop(key, None)
        self._settle(key, data)

    def _overloaded(self, spec: GrammarSpec, fingerprint: str, key: str) -> bytes:
        self.counts.overloaded += 1
        self._m_requests.inc(tags={"result": "overloaded"})
        return envelope.pack_error(
            f"the grammar cache has {self.queue.waiting} compiles waiting (the limit is "
            f"{self.config.max_queued_compiles}: grammar_cache.max_queued_compiles); this new "
            f"{spec.kind} grammar was not queued: retry in a few seconds",
            fingerprint, key, ErrorKind.OVERLOADED)

    def _fail(self, key: str, exc: BaseException) -> None:
        fut = self.inflight.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)
            fut.exception()  # retrieved: no "never retrieved" warning without joiners

    # leases ---------------------------------------------------------------------------

    def lease_timeout_s(self) -> float:
        """How long a lease holds before the compile is done here instead: the holder's
        compile (its limit, with the wall-time backstop) and its serialization."""
        return WALL_FACTOR * self.config.compile_timeout_s + LEASE_SERIALIZE_S

    def _grant(self, spec: GrammarSpec, fingerprint: str, key: str) -> None:
        self.counts.leases += 1
        self.counts.compiles += 1  # the worker's compile is this grammar's compile
        timer = asyncio.get_running_loop().call_later(self.lease_timeout_s(), self._lapse, key)
        self.leases[key] = (spec, fingerprint, timer)

    def publish(self, fingerprint: str, key: str, data: bytes) -> bool:
        """The lease holder's result: an envelope (the grammar, a verdict, or the grammar's
        own error). Kept and handed to whoever waits; False when the lease had lapsed (the
        grammar was compiled here meanwhile) or the envelope is not for this key."""
        lease = self.leases.get(key)
        if lease is None or lease[1] != fingerprint:
            self.counts.late_publishes += 1
            return False
        try:
            env = envelope.read_header(data)
            if env.get("key") != key or env.get("fp") != fingerprint:
                raise envelope.EnvelopeMismatch("another key or tokenizer")
        except envelope.EnvelopeMismatch:
            logger.warning("a worker published something else than the envelope of %s", key)
            self.release(fingerprint, key)
            return False
        del self.leases[key]
        lease[2].cancel()
        self.counts.lease_publishes += 1
        if "error" in env:
            self.counts.errors += 1
            if ErrorKind.parse(env.get("error_kind")).client_fault:
                self._keep_error(key, data)
        else:
            self._keep(fingerprint, key, data)
        self._settle(key, data)
        return True

    def release(self, fingerprint: str, key: str) -> None:
        """The lease holder gives the compile back (its compile passed the limit, or failed
        for a reason that is not the grammar's): it is compiled here, in a child process
        under the limits, for the holder and everyone waiting."""
        lease = self.leases.pop(key, None)
        if lease is None:
            return
        lease[2].cancel()
        self.counts.lease_releases += 1
        self._compile_lease(key, lease)

    def _lapse(self, key: str) -> None:
        lease = self.leases.pop(key, None)
        if lease is not None:  # the holder died or hung: compile it here
            self.counts.lease_lapses += 1
            logger.warning("a worker's lease on %s lapsed; compiling it here", key)
            self._compile_lease(key, lease)

    def _compile_lease(self, key: str, lease) -> None:
        spec, fingerprint, _ = lease

        async def run():
            try:  # its holder and the others were promised this compile: never refused
                data = await self._compile(spec, fingerprint, key, None,
                                           self.queue.enter(None, force=True))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiters
                self._fail(key, exc)
                return
            self._settle(key, data)
        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _settle(self, key: str, data: bytes) -> None:
        fut = self.inflight.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(data)

    def _keep(self, fingerprint: str, key: str, data: bytes) -> None:
        self.lru.put(key, data)
        self._m_bytes.set(self.lru.bytes)
        if self.disk is not None:  # in the background: the askers need not wait for it
            self._disk_threads.submit(self.disk.put, fingerprint, key,
                                      data).add_done_callback(_log_disk_error)

    def _keep_error(self, key: str, data: bytes) -> None:
        self.errors[key] = (data, time.monotonic() + self.config.error_ttl_s)
        while len(self.errors) > self.config.max_errors:
            self.errors.popitem(last=False)

    async def _from_disk(self, fingerprint: str, key: str) -> bytes | None:
        """The envelope this node's disk keeps for the key (checked: versions, tokenizer,
        key), or None."""
        if self.disk is None:
            return None
        data = await asyncio.get_running_loop().run_in_executor(
            self._disk_threads, self.disk.get, fingerprint, key)
        if data is None:
            return None
        try:
            env = envelope.read_header(data)
        except envelope.EnvelopeMismatch:
            return None
        if any(env.get(f) != v for f, v in envelope._header(fingerprint, key).items()) or (
                "error" in env):
            return None
        self.counts.disk_hits += 1
        self.lru.put(key, data)
        self._m_bytes.set(self.lru.bytes)
        return data

    async def _compile(self, spec: GrammarSpec, fingerprint: str, key: str, client,
                       ticket: asyncio.Future) -> bytes:
        """Compiles once ``ticket`` (a place in the CompileQueue) gives it a slot. Cancelled
        while it waits: it leaves the line; while it compiles: the compile process is
        killed (CompilePool.compile's ``cancel``)."""
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        self.compiling += 1
        try:
            await ticket
            t = time.perf_counter()
            work = loop.run_in_executor(
                self._compile_threads, lambda: self.pool.compile(
                    spec, fingerprint, self.tokenizers[fingerprint], key, cancel=cancel))
            try:
                result: CompileResult = await asyncio.shield(work)
            except asyncio.CancelledError:
                cancel.set()
                await asyncio.wait([work])  # the child is killed within a poll (50 ms)
                raise
            elapsed = time.perf_counter() - t
        finally:
            self.compiling -= 1
            self.queue.leave(client, ticket)
        self.counts.compiles += 1
        self.compile_times.append(elapsed)
        self._m_compile.observe(elapsed, tags={"kind": spec.kind})
        data = result.data
        if result.error_kind is not None:
            self.counts.errors += 1
            if result.error_kind is ErrorKind.COMPILE_TIMEOUT:
                self.counts.timeouts += 1
            if result.cacheable:
                self._keep_error(key, data)
            else:  # a compile process died: not the grammar's fault, ask again next time
                self.counts.unavailable += 1
        else:
            if result.load_s >= self.config.local_verdict_factor * result.compile_s:
                # xgrammar's serialization of this grammar loads slower than it compiles:
                # keep (and send) a small verdict instead; workers compile it themselves,
                # knowing it compiles within the limits
                data = envelope.pack_local(fingerprint, key, result.compile_s)
                self.counts.local_verdicts += 1
            self._keep(fingerprint, key, data)
        return data

    def _cached_error(self, key: str) -> bytes | None:
        item = self.errors.get(key)
        if item is None:
            return None
        if time.monotonic() > item[1]:
            del self.errors[key]
            return None
        return item[0]

    def stats(self) -> dict:
        distinct = len(self.distinct)
        return {**self.counts.as_dict(), "entries": len(self.lru), "bytes": self.lru.bytes,
                "distinct_grammars": distinct,
                # 1.0: every grammar the cluster asked for was compiled exactly once (disk
                # hits count as no compile)
                "compiles_per_distinct_grammar": (self.counts.compiles / distinct
                                                  if distinct else 0.0),
                "disk": self.disk.stats() if self.disk is not None else {},
                "max_bytes": self.config.max_bytes, "evictions": self.lru.evictions,
                "cached_errors": len(self.errors), "tokenizers": len(self.tokenizers),
                "compile_p50_s": percentile(self.compile_times, 50, 0.0),
                "compile_p99_s": percentile(self.compile_times, 99, 0.0),
                "compile_crashes": self.pool.crashes, "ready": self._ready.is_set(),
                **self.checked.stats(),
                "responses_stored": len(self.responses),
                "responses_stored_chars": self.responses.chars,
                "config": self.config.model_dump()}

    def close(self) -> None:
        self.pool.close()
        self._compile_threads.shutdown(wait=False)
        self._disk_threads.shutdown(wait=True)  # what was compiled is on disk


def _log_disk_error(write) -> None:
    if not write.cancelled() and write.exception() is not None:
        logger.warning("writing a compiled grammar to disk failed: %s", write.exception())


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)
class GrammarCacheActor:
    """The named cluster-wide cache; see the module docstring. ``config``: the
    GrammarCacheConfig (built once by its caller; it crosses Ray as the object)."""

    def __init__(self, config: GrammarCacheConfig | None = None):
        # does not wait for the compile processes: ping answers at once, ready() says when
        # compiles can start (a blocking __init__ made every call, ping included, wait)
        self.cache = GrammarCache(config)

    async def ready(self, timeout_s: float | None = None) -> bool:
        return await self.cache.ready(timeout_s)

    def register_tokenizer(self, fingerprint: str, tokenizer_json: str) -> None:
        self.cache.register_tokenizer(fingerprint, tokenizer_json)

    async def get(self, spec: GrammarSpec, fingerprint: str, lease: bool = False,
                  client: str | None = None) -> bytes | None:
        return await self.cache.get(spec, fingerprint, lease, client)

    # async: run on the actor's event loop, where the cache's futures and timers live
    async def publish(self, fingerprint: str, key: str, data: bytes) -> bool:
        return self.cache.publish(fingerprint, key, data)

    async def release(self, fingerprint: str, key: str) -> None:
        self.cache.release(fingerprint, key)

    def hot(self, fingerprint: str, since: int = 0, uses: list = ()) -> dict:
        return self.cache.hot(fingerprint, since, uses)

    def stats(self) -> dict:
        return self.cache.stats()

    def remember_checked(self, owner: str | None, grammar_id: str, spec: GrammarSpec,
                         report: dict) -> None:
        """Keeps a checked grammar's spec and report under ``owner`` (the client that
        checked it) and its id (grammar_cache/checked.py)."""
        self.cache.checked.put(owner, grammar_id, spec, report)

    def checked(self, owner: str | None, grammar_id: str) -> tuple[GrammarSpec, dict] | None:
        """The spec and report ``owner`` checked under ``grammar_id``, None when unknown
        (never checked by this owner, or forgotten: the bounds, a restart)."""
        return self.cache.checked.get(owner, grammar_id)

    def remember_response(self, owner: str, response_id: str, messages: list[dict],
                          ttl_s: float | None = None) -> bool:
        """Keeps a Responses conversation under its owner (the tenant) and id for every
        front end (core/response_store.py); False when it alone is over the bound."""
        return self.cache.responses.put(owner, response_id, messages, ttl_s)

    def stored_response(self, owner: str, response_id: str) -> list[dict] | None:
        """The conversation ``owner`` stored under ``response_id``, None when unknown
        (never stored, another owner's, expired, pushed out, or the actor restarted)."""
        return self.cache.responses.get(owner, response_id)

    def compile_pids(self) -> dict[int, str]:
        """pid -> key of each compile process busy compiling (for operators and tests)."""
        return dict(self.cache.pool.busy)

    def ping(self) -> bool:
        return True


def get_or_create_actor(config: GrammarCacheConfig | None = None, *, detached: bool = False,
                        name: str = ACTOR_NAME, namespace: str = NAMESPACE,
                        resources: dict | None = None):
    """The cluster's grammar cache actor, created on first use (``ray.init`` must have run).
    Returns at once; ``wait_ready(actor)`` waits for its compile processes. ``resources``:
    custom Ray resources it needs (to place it on some nodes)."""
    return GrammarCacheActor.options(
        name=name, namespace=namespace, get_if_exists=True,
        lifetime="detached" if detached else None, resources=resources or {},
    ).remote(config or GrammarCacheConfig())


def wait_ready(actor, timeout_s: float = 120.0) -> None:
    """Blocks until the cache actor can compile (its process and its compile processes are
    up); raises TimeoutError after ``timeout_s``. Start-up code calls this before workers
    start taking requests, so none of them falls back to compiling by itself at start."""
    try:
        ok = ray.get(actor.ready.remote(timeout_s), timeout=timeout_s + 5)
    except ray.exceptions.GetTimeoutError:
        ok = False
    if not ok:
        raise TimeoutError(f"the grammar cache actor was not ready within {timeout_s:g} s")
