"""RuntimeClient: how a front end (the Serve ingress, the batch job, tests) talks to the
runtime. It asks the scheduler for a request's worker (its session's, else by its prompt's
prefix keys: core/prefix_keys.py), then streams the request straight from that worker. If
the worker dies before the request streamed anything, the scheduler is told (it stops
routing there at once) and the request is retried on another worker; if it dies after
tokens were streamed, the request continues on another worker from where it stopped (at
most ``max_failovers`` times; after that, a clear error chunk, never a silent truncation).

Requests and chunks cross Ray as typed objects (``GenerationRequest`` with its
``GrammarSpec`` and cached key, ``RequestOutput``: core/). This module is the front ends'
one door into the runtime, so deploy/ imports nothing below cluster/ but core/.

Why one module: routing, streaming with failover, grammar checks and the stores kept in
the cache actor (checked grammars, Responses conversations) share one client's state (the
workers it knows, its requests in flight and their ends told to the scheduler, its
handles to the scheduler and the cache actor); split, each part would reach into the
others' fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict, deque
from typing import AsyncIterator

import ray
from ray.exceptions import (ActorDiedError, ActorUnavailableError, GetTimeoutError,
                            RayActorError)

from cluster.channels import WorkerChannel, detach_from_request
from core.backoff import backoff
from core.errors import ErrorKind, GrammarUnavailable, NoWorkers
from core.grammar_spec import GrammarSpec, grammar_id, is_grammar_id
from core.percentile import percentile
from core.prefix_keys import prefix_keys, prompt_tokens_estimate
from core.request import GenerationRequest, RequestOutput
from grammar_cache.actor import ACTOR_NAME as CACHE_NAME
from grammar_cache.checked import CheckedGrammars
from scheduler.actor import NAMESPACE, SCHEDULER_NAME
from scheduler.routing import CHECK_COST_TOKENS

logger = logging.getLogger(__name__)

_WORKER_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
# what a front end sees when the runtime underneath fails (not a bug, not the client's)
INFRASTRUCTURE_ERRORS = (*_WORKER_GONE, GetTimeoutError)


def _actor_id(handle):
    """Which actor a handle reaches (each route brings a new handle object; a worker
    rebuilt under the same name is another actor)."""
    return getattr(handle, "_actor_id", handle)


@dataclasses.dataclass
class RuntimeClientStats:
    """A front end's runtime client: counters, and gauges filled in by ``stats()``
    (rendered as ``rayguide_replica_<name>`` on /metrics)."""

    retries: int = 0  # requests sent again after their worker died before streaming
    failovers: int = 0  # requests continued on another worker after a mid-stream death
    resumed_tokens: int = 0  # tokens those continuations did not have to generate again
    own_routes: int = 0  # routed without the scheduler (it was restarting)
    route_timeouts: int = 0  # route calls given up after route_timeout_s
    route_timeout_s: float = 0.0  # the setting, for reading the counter above
    failover_pause_max_s: float = 0.0  # worker death -> continuation sent
    failover_pause_p50_s: float = 0.0
    scheduler_down: int = 0  # 1 while the scheduler is known to be down
    scheduler_outages: int = 0  # times it was noticed down (a short outage a scrape misses)


class RuntimeClient:
    """While the scheduler restarts, callers do not wait for it: sessions stay on their
    workers and new requests go to the known worker with the fewest of this client's
    requests in flight. The client learns of a restart at once from a long poll it keeps
    open on the scheduler (``watch``, which fails when the scheduler dies). A route call
    that hangs for another reason is given up after ``route_timeout_s``, and
    the client then routes on its own for ``skip_after_timeout_s`` before it asks the
    scheduler again. (The timeout is fixed, not tied to the scheduler's recent speed: on a
    busy machine that fires often, and routes made without the scheduler lose grammar
    affinity.) With no worker known yet, it waits for the scheduler, up to
    ``scheduler_wait_s``."""

    def __init__(self, scheduler=None, *, max_attempts: int = 3,
                 scheduler_wait_s: float = 30.0, route_timeout_s: float = 1.0,
                 skip_after_timeout_s: float = 1.0,
                 max_remembered_sessions: int = 100_000, max_failovers: int = 2):
        # a scheduler found by name is found again when it died for good and was rebuilt
        # (rayguide serve's self-healing starts a new actor under the same name)
        self._by_name = scheduler is None
        self.scheduler = scheduler or ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
        self.max_attempts = max_attempts
        self.scheduler_wait_s = scheduler_wait_s
        self.route_timeout_s = route_timeout_s
        self.skip_after_timeout_s = skip_after_timeout_s
        self._skip_until = 0.0
        self.counts = RuntimeClientStats()
        self.max_failovers = max_failovers
        self.failover_pauses: deque[float] = deque(maxlen=1024)  # death -> continuation sent
        self._workers: dict[str, object] = {}  # worker id -> handle, as routes revealed them
        self._in_flight: dict[str, int] = {}  # worker id -> this client's open requests
        # requests that ended since the last route, told to the scheduler with the next
        # (worker id, the route's epoch, expected tokens): RoutingTable.finished
        self._ended: deque[tuple[str, int, int]] = deque(maxlen=4096)
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session -> worker id
        self._max_sessions = max_remembered_sessions
        # set while the scheduler is known to be down: a long poll on it (watch) fails the
        # moment it dies, and routes then go on from what this client knows, without waiting
        self.scheduler_down_since: float | None = None
        self._watcher: asyncio.Task | None = None
        # grammars checked through this front end (POST /v1/grammars), by id; the cache
        # actor holds the cluster's
        self._checked = CheckedGrammars(max_bytes=16 * 2**20)
        self._cache = None
        self._channels: dict[str, WorkerChannel] = {}  # worker id -> this client's channel

    async def _call_scheduler(self, method: str, *args):
        """A scheduler call that rides out a scheduler restart: Ray restarts the actor
        (max_restarts=-1) and the same handle reaches the new instance, so an unavailable
        scheduler is retried with backoff for up to ``scheduler_wait_s``."""
        deadline = time.monotonic() + self.scheduler_wait_s
        delays = backoff(0.05, 1.0)
        while True:
            try:
                return await getattr(self.scheduler, method).remote(*args)
            except _WORKER_GONE as exc:
                delay = next(delays)
                if time.monotonic() + delay > deadline:
                    raise
                if isinstance(exc, ActorDiedError):
                    self._find_scheduler()
                await asyncio.sleep(delay)

    def _find_scheduler(self) -> None:
        if self._by_name:
            try:
                self.scheduler = ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
            except ValueError:
                pass  # not rebuilt yet

    def _ensure_watching(self) -> None:
        loop = asyncio.get_running_loop()
        if self._watcher is None or self._watcher.done() or self._watcher.get_loop() is not loop:
            self._watcher = loop.create_task(self._watch())

    async def _watch(self) -> None:
        detach_from_request()  # started by a request; it outlives that request
        delays = backoff(0.05, 1.0)
        while True:
            try:
                await self.scheduler.watch.remote(0.0)  # answers once up and rebuilt
                if self.scheduler_down_since is not None:
                    logger.info("scheduler back after %.2f s",
                                time.monotonic() - self.scheduler_down_since)
                self.scheduler_down_since, delays = None, backoff(0.05, 1.0)
                await self.scheduler.watch.remote(30.0)
            except _WORKER_GONE as exc:
                if self.scheduler_down_since is None:
                    self.scheduler_down_since = time.monotonic()
                    self.counts.scheduler_outages += 1
                    logger.warning("scheduler unavailable (%s); routing from the last known "
                                   "workers until it is back", type(exc).__name__)
                if isinstance(exc, ActorDiedError):
                    self._find_scheduler()
                await asyncio.sleep(next(delays))
            except Exception:  # noqa: BLE001 - the watch only informs routing: never fatal
                logger.debug("scheduler watch failed", exc_info=True)
                await asyncio.sleep(1.0)

    async def _route(self, session_id, expected: int, family,
                     avoid: frozenset[str] = frozenset(), keys: list[str] | None = None
                     ) -> dict:
        """``avoid``: workers this request already died on (its retries and continuations go
        elsewhere while another worker is known). ``keys``: the prompt's prefix keys
        (core/prefix_keys.py), which the scheduler routes by."""
        self._ensure_watching()
        if self.scheduler_down_since is not None or time.monotonic() < self._skip_until:
            route = self._own_route(session_id, avoid)
            if route is not None:
                return route
        ended = {}
        if self._ended:  # (sent once: a report lost with a failed call only waits for
            # the worker's next load report)
            ended = {"done": list(self._ended)}
            self._ended.clear()
        try:
            route = await asyncio.wait_for(
                self.scheduler.route.remote(session_id, expected, family, sorted(avoid),
                                            keys, **ended),
                self.route_timeout_s)
        except (*_WORKER_GONE, asyncio.TimeoutError) as exc:
            if isinstance(exc, ActorDiedError):
                self._find_scheduler()
            if isinstance(exc, asyncio.TimeoutError):
                self.counts.route_timeouts += 1
                self._skip_until = time.monotonic() + self.skip_after_timeout_s
                log = logger.warning if self.counts.route_timeouts == 1 else logger.debug
                log("the scheduler did not route in %.2f s; routing from the last known "
                    "workers for %.1f s (logged once; counted in route_timeouts)",
                    self.route_timeout_s, self.skip_after_timeout_s)
            route = self._own_route(session_id, avoid)
            if route is not None:
                return route
            route = await self._call_scheduler("route", session_id, expected, family,
                                               sorted(avoid), keys)
        self._remember(session_id, route)
        return route

    def _own_route(self, session_id, avoid: frozenset[str] = frozenset()) -> dict | None:
        """A route from what this client last knew, or None when it knows no worker (or
        only workers in ``avoid``)."""
        known = [w for w in self._workers if w not in avoid]
        if not known:
            return None
        worker_id = self._sessions.get(session_id) if session_id is not None else None
        if worker_id not in known:
            worker_id = min(known, key=lambda w: (self._in_flight.get(w, 0), w))
        self.counts.own_routes += 1
        route = {"worker_id": worker_id, "handle": self._workers[worker_id]}
        self._remember(session_id, route)  # the restarted scheduler learns it from the worker
        return route

    def _remember(self, session_id, route: dict) -> None:
        self._workers[route["worker_id"]] = route["handle"]
        if session_id is not None:
            self._sessions[session_id] = route["worker_id"]
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)

    def _forget_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        # its channel fails on its own with the worker's death, and its other requests
        # continue elsewhere from that; the next request to this worker opens a new one
        self._channels.pop(worker_id, None)
        for sid in [s for s, w in self._sessions.items() if w == worker_id]:
            del self._sessions[sid]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Streams the request's chunks as WorkerActor.generate yields them. A bad request
        raises ValueError; Overloaded / NoWorkers come from the scheduler.

        A worker that dies before streaming anything costs a retry on another worker. One
        that dies mid-stream costs a pause: the request continues on another worker from
        the tokens already streamed (``resume_token_ids``: their KV is recomputed, the
        grammar matcher advanced over them, nothing is emitted twice), at most
        ``max_failovers`` times; after that, or when the continuation cannot be resumed, the
        stream ends with a WORKER_DIED error chunk."""
        session_id = request.session_id
        # what it adds to a worker's load: its prompt (reported loads count running
        # prompts) and its budget
        expected = request.params.max_new_tokens + prompt_tokens_estimate(request.prompt)
        family = request.grammar.family if request.grammar is not None else None
        # the engine's cache is partitioned by cache_scope (a tenant; None: shared)
        keys = prefix_keys(request.prompt, getattr(request, "cache_scope", None))
        current, emitted, failovers, attempt = request, [], 0, 0
        emitted_text: list[str] = []
        died_on: set[str] = set()  # workers this request died on: its next tries go elsewhere
        while attempt < self.max_attempts:
            attempt += 1
            route = await self._route_after_deaths(session_id, expected, family, died_on,
                                                   keys)
            worker_id = route["worker_id"]
            self._in_flight[worker_id] = self._in_flight.get(worker_id, 0) + 1
            finished = False
            try:
                async with contextlib.aclosing(self._chunks(route, current)) as chunks:
                    async for chunk in chunks:
                        finished = chunk.finished
                        if current is not request:  # a continuation speaks for the original
                            chunk.request_id = request.request_id
                        emitted.extend(chunk.token_ids)
                        emitted_text.append(chunk.text)
                        yield chunk
                return
            except _WORKER_GONE as exc:
                finished = True  # nothing left to abort there
                died_at = time.monotonic()
                died_on.add(worker_id)
                await self._report_failed(worker_id)
                if emitted:
                    if len(emitted) >= request.params.max_new_tokens:
                        # every token was streamed, the final chunk (finish reason,
                        # validation) was not: there is nothing to continue, and a
                        # continuation would be refused as a bad request (a batch job
                        # counted such a row "refused" where a resend helps)
                        yield RequestOutput(
                            request.request_id, finished=True, finish_reason="error",
                            error_kind=ErrorKind.WORKER_DIED,
                            error=f"worker {worker_id} died after streaming this request's "
                                  f"last token ({type(exc).__name__}), before its final "
                                  "report; resend it")
                        return
                    if failovers >= self.max_failovers:
                        yield RequestOutput(
                            request.request_id, finished=True, finish_reason="error",
                            error_kind=ErrorKind.WORKER_DIED,
                            error=f"worker {worker_id} died while streaming this request "
                                  f"({type(exc).__name__}) after {failovers} failovers; "
                                  "resend it")
                        return
                    failovers += 1
                    attempt = 0  # a continuation gets its own retries
                    self.counts.failovers += 1
                    self.counts.resumed_tokens += len(emitted)
                    current = dataclasses.replace(
                        request, request_id=f"{request.request_id}-f{failovers}",
                        resume_token_ids=list(emitted), resume_text="".join(emitted_text))
                    self.failover_pauses.append(time.monotonic() - died_at)
                    logger.warning("worker %s died mid-stream; request %s continues on "
                                   "another worker after %d tokens", worker_id,
                                   request.request_id, len(emitted))
                    continue
                self.counts.retries += 1
                logger.warning("worker %s died before streaming; retrying (attempt %d)",
                               worker_id, attempt + 1)
            finally:
                self._in_flight[worker_id] -= 1
                if "epoch" in route:  # the scheduler's load for it ends with it
                    self._ended.append((worker_id, route["epoch"], expected))
                # the caller stopped early (client disconnected, task cancelled): free the
                # request's KV and matcher on the worker now, not when it would have ended
                if not finished:
                    try:
                        route["handle"].abort.remote(current.request_id)
                    except Exception:  # the worker is gone: nothing to free
                        pass
        raise NoWorkers(f"the request failed on {self.max_attempts} workers in a row "
                        "(each died before answering)")

    async def _chunks(self, route: dict, request: GenerationRequest
                      ) -> AsyncIterator[RequestOutput]:
        """The request's chunks from its worker: through this client's channel to the
        worker (cluster/channels.py), or, from a worker without one, its own stream."""
        handle = route["handle"]
        if not hasattr(handle, "submit"):
            async for ref in handle.generate.remote(request):
                yield await ref
            return
        channel = self._channel(route)
        inbox = channel.open(request.request_id)
        try:
            await handle.submit.remote(request, channel.channel_id)
            while True:
                chunk = await inbox.take()
                yield chunk
                if chunk.finished:
                    return
        finally:
            channel.close(request.request_id)

    def _channel(self, route: dict) -> WorkerChannel:
        """This event loop's open channel to the route's worker (a new one after the
        last failed)."""
        worker_id, loop = route["worker_id"], asyncio.get_running_loop()
        channel = self._channels.get(worker_id)
        if (channel is None or channel.failed is not None or channel.loop is not loop
                or _actor_id(channel.handle) != _actor_id(route["handle"])):
            channel = self._channels[worker_id] = WorkerChannel(route["handle"], worker_id)
        return channel

    async def _route_after_deaths(self, session_id, expected: int, family,
                                  died_on: set[str], keys: list[str] | None = None) -> dict:
        """A route that avoids the workers this request died on. When every registered
        worker has (all down at once, restarting), the request waits for one to answer
        again, up to ``scheduler_wait_s``, instead of spending its failovers in
        milliseconds on workers that are still restarting."""
        route = await self._route(session_id, expected, family, frozenset(died_on), keys)
        deadline = time.monotonic() + self.scheduler_wait_s
        delays = backoff(0.1, 1.0)
        while route["worker_id"] in died_on and time.monotonic() < deadline:
            try:  # a worker restarted under the same name answers again
                await asyncio.wait_for(route["handle"].load.remote(), 1.0)
                return route
            except (*_WORKER_GONE, asyncio.TimeoutError):
                await asyncio.sleep(next(delays))
            route = await self._route(session_id, expected, family, frozenset(died_on), keys)
        return route

    def stats(self) -> RuntimeClientStats:
        """A copy of this client's counters, its failover pauses and whether the scheduler
        is down now (a front end's /metrics renders every field)."""
        return dataclasses.replace(
            self.counts, route_timeout_s=self.route_timeout_s,
            failover_pause_max_s=max(self.failover_pauses, default=0.0),
            failover_pause_p50_s=percentile(self.failover_pauses, 50, 0.0),
            scheduler_down=int(self.scheduler_down_since is not None))

    async def _report_failed(self, worker_id: str) -> None:
        """Tells the scheduler (briefly: a restarting scheduler finds the dead worker by
        its own load poll) and stops routing there from this client at once."""
        self._forget_worker(worker_id)
        try:
            await asyncio.wait_for(self.scheduler.worker_failed.remote(worker_id), 2.0)
        except (*_WORKER_GONE, asyncio.TimeoutError):
            pass

    async def complete(self, request: GenerationRequest) -> RequestOutput:
        """The whole output as one RequestOutput (the chunks merged)."""
        out = RequestOutput(request.request_id)
        async for chunk in self.generate(request):
            out.merge(chunk)
        return out

    async def check_grammar(self, spec: GrammarSpec, client: str | None = None,
                            wait_s: float | None = None) -> dict:
        """The grammar check's report on ``spec`` (worker/guided/grammar_check.py), from a
        worker routed to as the spec's requests are (grammar affinity), so the compile it
        makes is the one they find. A worker that dies before answering costs a retry
        elsewhere; a transient compile failure raises (GrammarUnavailable, in a
        RayTaskError), a grammar error is in the report. ``wait_s``: how long the worker
        waits for the compile before it reports "compiling" (None: its grammar wait)."""
        died_on: set[str] = set()
        for attempt in range(self.max_attempts):
            route = await self._route_after_deaths(None, CHECK_COST_TOKENS, spec.family,
                                                   died_on)
            try:
                report = await route["handle"].check_grammar.remote(spec, client, wait_s)
            except _WORKER_GONE:
                died_on.add(route["worker_id"])
                await self._report_failed(route["worker_id"])
                continue
            report["worker_id"] = route["worker_id"]
            return report
        raise NoWorkers(f"the grammar check failed on {self.max_attempts} workers in a row "
                        "(each died before answering)")

    async def remember_checked(self, owner: str | None, grammar_id: str, spec: GrammarSpec,
                               report: dict) -> None:
        """Keeps the checked grammar under ``owner`` (the client that checked it:
        grammar_cache/checked.py) and its id: in this front end, and in the shared cache
        actor (where every front end finds it) when the runtime has one."""
        self._checked.put(owner, grammar_id, spec, report)
        cache = await self._cache_actor()
        if cache is not None:
            try:
                await asyncio.wait_for(
                    cache.remember_checked.remote(owner, grammar_id, spec, report),
                    self.scheduler_wait_s)
            except Exception as exc:  # noqa: BLE001 - kept here all the same
                logger.warning("could not keep grammar %s in the grammar cache (%r); only "
                               "this front end knows it", grammar_id, exc)

    async def checked(self, owner: str | None,
                      grammar_id: str) -> tuple[GrammarSpec, dict] | None:
        """The spec and report ``owner`` checked under ``grammar_id``: the shared cache
        actor's (the newest, whichever front end checked it last), else this front end's
        own copy (the runtime runs without the actor, or it is unreachable); None when
        neither knows it for this owner."""
        cache = await self._cache_actor()
        if cache is not None:
            try:
                found = await asyncio.wait_for(cache.checked.remote(owner, grammar_id),
                                               self.scheduler_wait_s)
            except Exception:  # noqa: BLE001 - the actor down or slow: the local copy
                found = None
            if found is not None:
                self._checked.put(owner, grammar_id, *found)
                return found
        return self._checked.get(owner, grammar_id)

    async def remember_response(self, owner: str, response_id: str, messages: list[dict],
                                ttl_s: float | None = None) -> bool:
        """Keeps a Responses conversation in the shared cache actor, where every front end
        finds it (core/response_store.py); False when the runtime runs without the actor,
        it did not answer, or the conversation alone is over its bound (the caller's own
        store still has it)."""
        cache = await self._cache_actor()
        if cache is None:
            return False
        try:
            return bool(await asyncio.wait_for(
                cache.remember_response.remote(owner, response_id, messages, ttl_s),
                self.scheduler_wait_s))
        except Exception as exc:  # noqa: BLE001 - kept by the caller's front end all the same
            logger.warning("could not keep response %s in the grammar cache (%r); only this "
                           "front end knows it", response_id, exc)
            return False

    async def stored_response(self, owner: str, response_id: str) -> list[dict] | None:
        """The conversation ``owner`` stored under ``response_id`` in the shared cache
        actor; None when it has none, or the runtime runs without it, or it did not
        answer."""
        cache = await self._cache_actor()
        if cache is None:
            return None
        try:
            return await asyncio.wait_for(cache.stored_response.remote(owner, response_id),
                                          self.scheduler_wait_s)
        except Exception:  # noqa: BLE001 - the actor down or slow: not found here
            return None

    async def _cache_actor(self):
        """The shared grammar cache actor, looked up by name (None: the runtime runs
        without one)."""
        if self._cache is None:
            try:
                self._cache = await asyncio.to_thread(ray.get_actor, CACHE_NAME,
                                                      namespace=NAMESPACE)
            except ValueError:
                return None
        return self._cache

    async def end_session(self, session_id: str) -> bool:
        """Ends the session; True when it was live (the scheduler had it pinned)."""
        return bool(await self._call_scheduler("end_session", session_id))
