"""SchedulerActor: routes sessions to workers and broadcasts session ends.

A named async Ray actor. Workers register themselves when they start (and again after Ray
restarts them). ``route(session)`` answers with a worker handle; tokens then flow directly
between the caller and the worker, never through here. Session ends are collected for a
few milliseconds and sent as one ``end_sessions([...])`` message per live worker, so a
burst of ends costs a handful of messages, not one per session and worker. A background
loop polls each worker's load and ends sessions idle past the timeout. A worker Ray reports
dead is dropped at once; one that is only slow to answer (a long step, a busy machine) is
marked suspect and routed around until it answers again, never dropped: on a busy cluster
every worker can be slow to answer at once, and dropping them would leave "no worker is
alive" while all of them are. After a restart the scheduler finds the workers by name and
rebuilds its tables from their reports; a worker too busy to answer then is asked again at
every poll until it does (it registered with the scheduler that died, and will not again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, replace

import ray
from pydantic import Field
from ray.exceptions import ActorDiedError

from core.config import ConfigModel
from scheduler.routing import RoutingTable

logger = logging.getLogger(__name__)

SCHEDULER_NAME = "rayguide_scheduler"
WORKER_PREFIX = "rayguide_worker_"
NAMESPACE = "rayguide"
MAX_UNDELIVERED = 100_000  # session ends kept per worker for a resend


class SchedulerConfig(ConfigModel):
    """Strict: a cap given as "10", 1.5 or true is an error naming ``scheduler.<key>``."""

    section = "scheduler"

    max_queued_tokens: int = Field(65536, ge=1)  # per worker; past it on every worker: overloaded
    session_idle_timeout_s: float = 600.0
    broadcast_interval_s: float = 0.005  # session ends are batched this long
    load_poll_interval_s: float = 0.5
    rpc_timeout_s: float = 10.0  # a worker that does not answer a load poll is suspect
    # a guided request goes to a worker holding its grammar when that worker's queued
    # tokens are within this margin of the least-loaded worker's
    affinity_margin_tokens: int = 2048
    # a request goes to the worker that was sent the longest prefix of its prompt when that
    # worker's queued tokens are within this margin of the least-loaded worker's (negative:
    # off); past it the request spills to the least loaded, which then holds the prefix too.
    # 4096 (about seven 600-token requests): once ended requests left the loads,
    # bench/prefix_cache.py (b) hit 0.94-0.96 of the prefix tokens at 1.10-1.45x the mean
    # load in six runs; 3072 balanced better (1.05-1.36x) but spilled more (0.84-0.96 in
    # eleven runs: a spill to a worker with a small cache evicts a prefix there, and the
    # misses cascade); 2048: 0.77-0.89
    prefix_margin_tokens: int = 4096
    # live sessions (each holds KV on its worker and rides every load report): a new
    # session past either cap is refused with a 429 naming session_id
    max_sessions_per_worker: int = Field(1024, ge=1)
    max_sessions: int = Field(16384, ge=1)


@dataclass
class SchedulerStats:
    """The scheduler's counters (rendered as ``rayguide_scheduler_<name>`` on /metrics),
    with two gauges filled in when ``stats()`` is asked."""

    routes: int = 0
    rejected: int = 0  # routes refused: overloaded, no worker
    registrations: int = 0  # worker registrations (a restarted worker registers again)
    sessions_ended: int = 0
    broadcast_messages: int = 0  # end_sessions messages sent (one per worker and batch)
    broadcast_failures: int = 0
    workers_dropped: int = 0  # confirmed dead
    workers_suspected: int = 0  # a load poll timed out: routed around until it answers
    affinity_routes: int = 0  # routed to a worker holding the grammar (the table counts)
    prefix_routes: int = 0  # routed to a worker holding the prompt's prefix (the table counts)
    sessions: int = 0  # sessions pinned now


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)
class SchedulerActor:
    def __init__(self, config: SchedulerConfig | None = None):
        self.config = config or SchedulerConfig()
        self.table = RoutingTable(self.config.max_queued_tokens,
                                  self.config.session_idle_timeout_s,
                                  self.config.affinity_margin_tokens,
                                  self.config.max_sessions_per_worker,
                                  self.config.max_sessions,
                                  self.config.prefix_margin_tokens)
        self._pending_ends: list[str] = []
        # resolved once the pending ends are sent (``end_session`` waits on it)
        self._sent: asyncio.Future | None = None
        self._undelivered: dict[str, list[str]] = {}  # worker -> ends it has not confirmed
        self._tasks: list[asyncio.Task] = []
        self._first_polls: set[asyncio.Task] = set()
        self._unfound: set[str] = set()  # named workers that did not answer the rebuild yet
        # how workers are found by name (Ray's registry; replaced in unit tests)
        self._names, self._lookup = _named_workers, _worker_handle
        self._started: asyncio.Task | None = None
        self._broadcast_lock = asyncio.Lock()
        self.rebuild_s: float | None = None
        self.counts = SchedulerStats()

    async def _ensure_started(self) -> None:
        """Starts the background loops and rebuilds the tables once; every call waits for
        that rebuild, so a restarted scheduler never answers NoWorkers while it is still
        finding its workers."""
        if self._started is None:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._broadcast_loop()),
                           loop.create_task(self._poll_loop())]
            self._started = loop.create_task(self._rediscover())
        await asyncio.shield(self._started)

    async def _rediscover(self) -> None:
        """Finds running workers by name (after a scheduler restart) and restores the
        sessions they hold. Its duration is in stats() as ``rebuild_s``."""
        started = time.monotonic()
        try:
            await self._find_workers()
        finally:
            self.rebuild_s = round(time.monotonic() - started, 3)
            if self.table.workers:
                logger.info("routing table rebuilt in %.3f s (%d workers)", self.rebuild_s,
                            len(self.table.workers))

    async def _find_workers(self, names: list[str] | None = None) -> None:
        """Adds the named workers (all of them, or ``names``) that answer a load report. One
        that does not answer in time (a long step, a busy machine) is kept in ``_unfound``
        and asked again at every poll until it answers or is gone: it registered with the
        scheduler that died and will not register again."""
        if names is None:
            names = self._names()

        async def one(name: str) -> None:
            try:
                handle = self._lookup(name)
            except ValueError:  # no longer exists
                self._unfound.discard(name)
                return
            try:
                load = await asyncio.wait_for(handle.load.remote(), self.config.rpc_timeout_s)
            except ActorDiedError:  # gone for good (a restarted one registers itself)
                self._unfound.discard(name)
                return
            except Exception:  # slow or restarting: asked again at the next poll
                self._unfound.add(name)
                return
            self._unfound.discard(name)
            if load["worker_id"] not in self.table.workers:  # else it registered meanwhile
                self.table.add_worker(load["worker_id"], handle, load.get("node_id", ""))
            self.table.update_load(load["worker_id"], load)
            self.table.restore_sessions(load["worker_id"], load.get("session_ids", []))

        await asyncio.gather(*(one(n) for n in names))  # a slow worker delays no other

    # the interface ----------------------------------------------------------------------

    async def register(self, worker_id: str, handle, node_id: str = "",
                       info: dict | None = None) -> None:
        """info: what the worker knows of itself at start (its model's name), shown in
        stats until its first load report."""
        await self._ensure_started()
        self.table.add_worker(worker_id, handle, node_id)
        if info:
            self.table.update_load(worker_id, info)
        self.counts.registrations += 1
        logger.info("worker %s registered (node %s)", worker_id, node_id)
        # its first load report now, not at the next poll (it answers once its start ends)
        entry = self.table.workers.get(worker_id)
        if entry is not None:
            task = asyncio.get_running_loop().create_task(self._poll_one(entry))
            self._first_polls.add(task)  # kept referenced until done
            task.add_done_callback(self._first_polls.discard)

    async def route(self, session_id: str | None = None, expected_tokens: int = 256,
                    grammar_family: str | None = None, avoid: list[str] | None = None,
                    prefix_keys: list[str] | None = None, done: list | None = None
                    ) -> dict:
        """{"worker_id", "handle"} of the worker for this session (sticky), else of the worker
        holding the longest prefix of the prompt (``prefix_keys``, within the prefix margin),
        else of one holding the grammar (within the affinity margin), else the least loaded;
        raises Overloaded or NoWorkers (scheduler/routing.py). ``avoid``: workers the
        request already died on (chosen only when no other worker is registered).
        ``done``: the caller's requests that ended since its last route, as (worker_id,
        epoch, expected tokens) (``RoutingTable.finished``); the answer's ``epoch`` is the
        one to send back for this request."""
        await self._ensure_started()
        if done:
            self.table.finished(done)
        try:
            entry = self.table.route(session_id, expected_tokens, grammar_family,
                                     avoid=frozenset(avoid or ()), prefix_keys=prefix_keys)
        except Exception:
            self.counts.rejected += 1  # Overloaded or NoWorkers
            raise
        self.counts.routes += 1
        return {"worker_id": entry.worker_id, "handle": entry.handle, "epoch": entry.reports}

    async def end_session(self, session_id: str) -> bool:
        """Ends the session (its end is broadcast to every worker either way); True when
        it was live here (pinned to a worker)."""
        await self._ensure_started()
        live = session_id in self.table.sessions
        await self.end_sessions([session_id])
        # answered once the batch carrying it was sent: a scheduler killed while an end
        # waited in its queue lost it, and the session stayed live on its worker until it
        # expired (a leak under load in CI); now the caller's call fails instead, and the
        # caller retries on the restarted scheduler, which sends it again
        if self._sent is None:
            self._sent = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._sent)
        return live

    async def end_sessions(self, session_ids: list[str]) -> None:
        """Queues the sessions for the next batched broadcast to every live worker."""
        await self._ensure_started()
        for sid in session_ids:
            self.table.end_session(sid)
        self._pending_ends.extend(session_ids)
        self.counts.sessions_ended += len(session_ids)

    async def worker_failed(self, worker_id: str) -> list[str]:
        """A caller saw a call to the worker fail: stop routing to it now. Dropped (and its
        orphaned sessions returned) when Ray confirms it dead; only suspect when it may just
        be unreachable for a moment."""
        entry = self.table.workers.get(worker_id)
        if entry is None:
            return []
        self.table.suspect(worker_id)
        try:
            await asyncio.wait_for(entry.handle.load.remote(), 1.0)
        except ActorDiedError:  # the entry asked about, not one registered since
            return self._drop(worker_id) if self.table.workers.get(worker_id) is entry else []
        except Exception:  # slow or restarting: the load poll decides
            pass
        return []

    async def watch(self, timeout_s: float = 30.0) -> None:
        """A long poll callers keep open: it returns (after at most ``timeout_s``) only
        while this scheduler is up and rebuilt, and fails at once when the scheduler dies,
        which is how a caller learns of a restart without waiting for a route to time out."""
        await self._ensure_started()
        await asyncio.sleep(timeout_s)

    async def stats(self) -> dict:
        await self._ensure_started()
        counts = replace(self.counts, sessions=len(self.table.sessions),
                         affinity_routes=self.table.affinity_routes,
                         prefix_routes=self.table.prefix_routes)
        return {**asdict(counts), "rebuild_s": self.rebuild_s,
                "config": self.config.model_dump(),
                "workers": {w.worker_id: _shown(w) for w in self.table.workers.values()}}

    async def flush(self) -> None:
        """Sends pending session ends now (tests, shutdown)."""
        await self._broadcast()

    # background -------------------------------------------------------------------------

    def _drop(self, worker_id: str) -> list[str]:
        if worker_id not in self.table.workers:
            return []
        self._undelivered.pop(worker_id, None)
        self.counts.workers_dropped += 1
        logger.warning("worker %s dropped from routing", worker_id)
        return self.table.drop_worker(worker_id)

    async def _broadcast(self) -> None:
        # one batch at a time: flush() waits for a batch the loop is still delivering
        async with self._broadcast_lock:
            await self._send_pending()

    async def _send_pending(self) -> None:
        if not self._pending_ends:
            return
        batch, self._pending_ends = self._pending_ends, []
        sent, self._sent = self._sent, None
        try:
            await self._send(batch)
        finally:
            if sent is not None and not sent.done():
                sent.set_result(None)

    async def _send(self, batch: list[str]) -> None:
        sends = []
        for entry in list(self.table.workers.values()):
            ids = self._undelivered.pop(entry.worker_id, []) + batch
            sends.append((entry.worker_id, ids, entry.handle.end_sessions.remote(ids)))
            self.counts.broadcast_messages += 1
        for worker_id, ids, ref in sends:
            try:
                await asyncio.wait_for(ref, self.config.rpc_timeout_s)
            except Exception as exc:
                # kept for that worker's next batch: a slow or restarting worker still
                # releases the sessions; a dead one is dropped by the load poll (and with
                # it, what it held)
                self.counts.broadcast_failures += 1
                if worker_id in self.table.workers:
                    self._undelivered[worker_id] = ids[-MAX_UNDELIVERED:]
                logger.warning("ending %d session(s) on worker %s failed (%s); will resend",
                               len(ids), worker_id, type(exc).__name__)

    async def _broadcast_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.broadcast_interval_s)
            await self._broadcast()

    async def _poll_one(self, entry) -> None:
        try:
            load = await asyncio.wait_for(entry.handle.load.remote(), self.config.rpc_timeout_s)
        except ActorDiedError:  # gone for good (a restarted worker registers again)
            # only the entry polled: the restarted worker may have registered under the
            # same id while this poll of its dead self was under way (dropping by id
            # dropped the new registration and unpinned its sessions: a CI flake)
            if self.table.workers.get(entry.worker_id) is entry:
                self._drop(entry.worker_id)
        except Exception:  # slow, restarting or unreachable: route around it meanwhile
            if self.table.workers.get(entry.worker_id) is not entry:
                return
            if not entry.suspect:
                self.counts.workers_suspected += 1
                logger.warning("worker %s did not answer a load poll in %.1f s; routing "
                               "around it until it does", entry.worker_id,
                               self.config.rpc_timeout_s)
            self.table.suspect(entry.worker_id)
        else:
            if self.table.workers.get(entry.worker_id) is entry:
                self.table.update_load(entry.worker_id, load)

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_poll_interval_s)
            await self._poll_once()

    async def _poll_once(self) -> None:
        # concurrently: one slow worker must not delay the others' reports
        await asyncio.gather(*(self._poll_one(e) for e in list(self.table.workers.values())),
                             self._find_workers(sorted(self._unfound)))
        idle = self.table.idle_sessions()
        if idle:
            await self.end_sessions(idle)


def _named_workers() -> list[str]:
    """The names of the running workers (Ray's registry of named actors)."""
    return [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
            if e["namespace"] == NAMESPACE and e["name"].startswith(WORKER_PREFIX)]


def _worker_handle(name: str):
    """The worker's handle; ValueError when no actor has the name."""
    return ray.get_actor(name, namespace=NAMESPACE)


def _shown(entry) -> dict:
    """A worker's row in stats(): its last load report, with the grammar families it holds
    as a count (plain data for JSON and metrics)."""
    load = {k: v for k, v in entry.load.items()
            if k not in ("grammar_families", "cheap_grammar_families")}
    load["grammars_held"] = len(entry.load.get("grammar_families", ()))
    return {"node_id": entry.node_id, "suspect": entry.suspect, **load}


def get_or_create_scheduler(config: SchedulerConfig | None = None, *, detached: bool = False,
                            resources: dict | None = None):
    return SchedulerActor.options(
        name=SCHEDULER_NAME, namespace=NAMESPACE, get_if_exists=True,
        lifetime="detached" if detached else None, resources=resources or {},
    ).remote(config or SchedulerConfig())
