"""RuntimeClient: how a front end (the Serve ingress, the batch job, tests) talks to the
runtime. It asks the scheduler for a session's worker, then streams the request straight
from that worker. If the worker dies before the request streamed anything, the scheduler
is told (it stops routing there at once) and the request is retried on another worker; if
it dies after tokens were streamed, the stream ends with a clear error chunk instead of a
silent truncation.

Requests and chunks cross Ray as typed objects (``GenerationRequest`` with its
``GrammarSpec`` and cached key, ``RequestOutput``). This module is the front ends' one door
into the runtime: it re-exports what they need, so deploy/ imports nothing below cluster/.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from grammar_cache.errors import ErrorKind, GrammarError, GrammarUnavailable
from grammar_cache.spec import GrammarSpec
from scheduler.actor import NAMESPACE, SCHEDULER_NAME
from scheduler.routing import NoWorkers, Overloaded
from worker.engine.sampling import SamplingParams
from worker.engine.sequence import GenerationRequest, RequestOutput

__all__ = ["RuntimeClient", "GenerationRequest", "RequestOutput", "SamplingParams",
           "GrammarSpec", "ErrorKind", "GrammarError", "GrammarUnavailable", "NoWorkers",
           "Overloaded", "RayTaskError", "NAMESPACE"]

logger = logging.getLogger(__name__)

_WORKER_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)


class RuntimeClient:
    def __init__(self, scheduler=None, *, max_attempts: int = 3,
                 scheduler_wait_s: float = 30.0):
        self.scheduler = scheduler or ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
        self.max_attempts = max_attempts
        self.scheduler_wait_s = scheduler_wait_s
        self.retries = 0

    async def _call_scheduler(self, method: str, *args):
        """A scheduler call that rides out a scheduler restart: Ray restarts the actor
        (max_restarts=-1) and the same handle reaches the new instance, so an unavailable
        scheduler is retried with backoff for up to ``scheduler_wait_s``."""
        deadline = time.monotonic() + self.scheduler_wait_s
        delay = 0.05
        while True:
            try:
                return await getattr(self.scheduler, method).remote(*args)
            except _WORKER_GONE:
                if time.monotonic() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Streams the request's chunks as WorkerActor.generate yields them. A bad request
        raises ValueError; Overloaded / NoWorkers come from the scheduler."""
        session_id = request.session_id
        expected = request.params.max_new_tokens
        family = request.grammar.family if request.grammar is not None else None
        for attempt in range(self.max_attempts):
            route = await self._call_scheduler("route", session_id, expected, family)
            streamed = finished = False
            try:
                async for ref in route["handle"].generate.remote(request):
                    chunk = await ref
                    streamed = True
                    finished = chunk.finished
                    yield chunk
                return
            except _WORKER_GONE as exc:
                finished = True  # nothing left to abort there
                try:
                    await self._call_scheduler("worker_failed", route["worker_id"])
                except _WORKER_GONE:
                    pass  # the restarted scheduler's load poll finds the dead worker
                if streamed:
                    yield RequestOutput(
                        request.request_id, finished=True, finish_reason="error",
                        error_kind=ErrorKind.WORKER_DIED,
                        error=f"worker {route['worker_id']} died while streaming this "
                              f"request ({type(exc).__name__}); resend it")
                    return
                self.retries += 1
                logger.warning("worker %s died before streaming; retrying (attempt %d)",
                               route["worker_id"], attempt + 2)
            finally:
                # the caller stopped early (client disconnected, task cancelled): free the
                # request's KV and matcher on the worker now, not when it would have ended
                if not finished:
                    try:
                        route["handle"].abort.remote(request.request_id)
                    except Exception:  # the worker is gone: nothing to free
                        pass
        raise RuntimeError(f"request failed on {self.max_attempts} workers in a row")

    async def complete(self, request: GenerationRequest) -> RequestOutput:
        """The whole output as one RequestOutput (the chunks merged)."""
        out = RequestOutput(request.request_id)
        async for chunk in self.generate(request):
            out.merge(chunk)
        return out

    async def end_session(self, session_id: str) -> None:
        await self._call_scheduler("end_session", session_id)
