"""Warm replication, the worker's side: a background asyncio task that keeps this worker
holding the cluster's hot grammars before any request for them arrives here.

Every ``replicate_interval_s`` it reports to the cache actor how many requests each grammar
had on this worker since the last report, and gets back the hot grammars added since its
cursor (grammar_cache/actor.py: ``hot``). For each one this worker lacks it calls
``prefetch(spec)`` (the engine's ``GuidedDecodingManager.get_grammar``: the fetch and its
deserialization, or the in-process compile of a "compile locally" verdict, run on the
manager's threads, never on the step loop) and awaits it, one at a time, so prefetching
takes at most one of those threads from requests and one core's worth of work from the
engine. It stops prefetching while the local LRU holds more than ``replicate_max_bytes``
(what requests ask for is still fetched). Prefetching is speculative, so it yields: while
requests on this worker wait for their own grammars, and while the cache actor has compiles
running or queued (requests somewhere wait for those, and on the actor's node a prefetch's
deserializing takes CPU from them), for at most ``MAX_DEFER_S`` at a stretch. Prefetched grammars are added to the families
the worker reports, so affinity routing sends their requests here too.

Nothing here knows the engine or Ray actors' classes: the worker hands in callables.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from typing import Callable

from grammar_cache.config import GrammarCacheConfig
from core.errors import GrammarError
from core.grammar_spec import GrammarSpec
from grammar_cache.stats import ReplicationStats

logger = logging.getLogger(__name__)

MAX_REMEMBERED = 100_000  # keys whose spec the actor was sent (beyond: sent again)
# the longest prefetching waits for the actor's compiles to drain (a cluster that never
# stops meeting new grammars still replicates)
MAX_DEFER_S = 30.0


class Replicator:
    def __init__(self, config: GrammarCacheConfig, fingerprint: str, *,
                 actor: Callable[[], object], prefetch: Callable[[GrammarSpec], Future],
                 holds: Callable[[GrammarSpec], bool], held_bytes: Callable[[], int],
                 on_held: Callable[[GrammarSpec], None] = lambda spec: None,
                 busy: Callable[[], bool] = lambda: False,
                 register: Callable[[], None] = lambda: None):
        """``actor()``: the cache actor's handle (may raise while it is missing).
        ``prefetch(spec)``: a concurrent Future of the compiled grammar. ``holds(spec)``:
        whether it is ready locally. ``held_bytes()``: bytes in the local LRU. ``busy()``:
        requests here are waiting for their own grammars (they go first: prefetching
        pauses, the rest of the list is taken up at the next poll). ``register()``: gives
        the actor this worker's tokenizer (blocking; run on a thread)."""
        self.config = config
        self.fingerprint = fingerprint
        self._actor, self._prefetch, self._holds = actor, prefetch, holds
        self._held_bytes, self._on_held, self._busy = held_bytes, on_held, busy
        self._register = register
        self._pending: list[GrammarSpec] = []  # hot grammars not yet looked at
        self.cursor = 0
        self._uses: dict[str, list] = {}  # key -> [requests, spec]
        self._sent: set[str] = set()  # keys whose spec the actor already has from us
        self.counts = ReplicationStats()
        self._task: asyncio.Task | None = None
        self._deferred_since: float | None = None  # while the actor's compiles held us back

    def used(self, spec: GrammarSpec) -> None:
        """Counts one request for ``spec`` on this worker (reported at the next poll)."""
        key = spec.key(self.fingerprint)
        entry = self._uses.get(key)
        if entry is None:
            self._uses[key] = [1, spec]
        else:
            entry[0] += 1

    def start(self) -> None:
        """Starts the task on the running loop (once)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the actor restarting, a dead handle
                self.counts.replication_poll_failures += 1
                logger.debug("grammar replication poll failed: %s", exc)
            await asyncio.sleep(self.config.replicate_interval_s)

    async def poll_once(self) -> int:
        """One report + fetch round; returns how many grammars it prefetched."""
        uses, self._uses = self._uses, {}
        report = []
        for key, (n, spec) in uses.items():
            report.append((key, n, None if key in self._sent else spec))
            self._sent.add(key)
        if len(self._sent) > MAX_REMEMBERED:
            self._sent.clear()
        try:
            answer = await self._actor().hot.remote(self.fingerprint, self.cursor, report)
        except BaseException:
            for key, n, spec in report:  # not lost: reported with the next poll
                self._sent.discard(key)
                self.used_n(key, n, spec or uses[key][1])
            raise
        if not answer["known"]:  # no request here yet, or the actor restarted: without
            await asyncio.to_thread(self._register)  # our tokenizer it has no hot list
            self.counts.replication_registrations += 1
        if answer["cursor"] < self.cursor:  # the actor restarted: its hot list starts
            self._sent.clear()  # over, and it knows none of the specs we sent
            answer = await self._actor().hot.remote(self.fingerprint, 0, [])
        elif not answer["known"]:
            answer = await self._actor().hot.remote(self.fingerprint, self.cursor, [])
        self.cursor, specs, compiling = answer["cursor"], answer["specs"], answer["compiling"]
        self.counts.replication_polls += 1
        if not self.config.replicate:
            return 0
        done = 0
        self._pending.extend(specs)
        if self._pending and compiling and self._defer_for_compiles():
            return 0
        self._deferred_since = None
        while self._pending:
            if self._busy():
                self.counts.prefetch_deferred += 1
                break
            spec = self._pending.pop(0)
            if self._holds(spec):
                self._on_held(spec)
                continue
            if self._held_bytes() >= self.config.replicate_max_bytes:
                self.counts.prefetch_skipped_budget += 1
                continue
            t = time.monotonic()
            try:
                await asyncio.wrap_future(self._prefetch(spec))
            except GrammarError:
                self.counts.prefetch_failures += 1  # known bad now: cached as an error
                continue
            except Exception as exc:  # noqa: BLE001 - transient: the next request fetches
                self.counts.prefetch_failures += 1
                logger.debug("prefetching %s failed: %s", spec.describe(), exc)
                continue
            finally:
                self.counts.prefetch_s += time.monotonic() - t
            self.counts.prefetches += 1
            self._on_held(spec)
            done += 1
        return done

    def _defer_for_compiles(self) -> bool:
        now = time.monotonic()
        if self._deferred_since is None:
            self._deferred_since = now
        if now - self._deferred_since >= MAX_DEFER_S:
            return False
        self.counts.prefetch_deferred_compiling += 1
        return True

    def used_n(self, key: str, n: int, spec: GrammarSpec) -> None:
        entry = self._uses.get(key)
        if entry is None:
            self._uses[key] = [n, spec]
        else:
            entry[0] += n

    def stats(self) -> dict:
        """The counters (``ReplicationStats``) as the dict the worker's ``load()`` carries."""
        return self.counts.as_dict()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
