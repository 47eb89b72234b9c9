"""Asyncio face of the engine, for the Ray worker actor and async callers.

One background thread owns the ``LLMEngine`` and runs its step loop while there is work
(torch releases the GIL inside kernels, so the event loop stays responsive). Callers never
touch the engine directly: requests, aborts and session ends go through an inbox that the
loop drains between steps. A step's outputs cross to each event loop in one call, and each
request keeps what it gained since its consumer last took it as one merged chunk
(``_Stream``): a consumer that keeps up gets every step's tokens as they come, one that
lags gets several steps' tokens in one chunk instead of a queue of one-token chunks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from worker.engine.engine import EngineStats, LLMEngine
from core.request import GenerationRequest, RequestOutput

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Submits a request and yields its chunks until the finished one, each chunk what
        the request gained since the caller last asked. A bad request raises ValueError
        before anything is yielded. If the caller stops iterating early (client gone), the
        request is aborted and its blocks freed."""
        stream = await self.open(request)
        finished = False
        try:
            while not finished:
                out = await stream.take()
                finished = out.finished
                yield out
        finally:
            self.close(request.request_id)
            if not finished:
                self.abort(request.request_id)

    async def open(self, request: GenerationRequest) -> "_Stream":
        """Submits a request; its chunks gather in the returned stream (``take``,
        ``take_now``; ``on_ready`` is called when one arrives) until ``close``. A bad
        request raises ValueError and leaves nothing behind."""
        loop = asyncio.get_running_loop()
        # tokenized here, on a thread of its own, never on the engine loop (a long prompt
        # held every other request's next token while it was tokenized there)
        prompt_ids = await loop.run_in_executor(self._tokenizer_pool,
                                                self.engine.encode_prompt, request.prompt)
        stream = _Stream(loop, request.client)
        done = loop.create_future()
        self._streams[request.request_id] = stream
        self._post(("add", (request, prompt_ids), (loop, done)))
        try:
            await done  # raises the validation error, if any
        except BaseException:
            self.close(request.request_id)
            if not done.done() or done.cancelled() or done.exception() is None:
                self.abort(request.request_id)  # cancelled while the engine took it
            raise
        return stream

    def serves_other_than(self, client) -> bool:
        """Whether a request of a client other than ``client`` (GenerationRequest.client)
        is open: its output still being delivered."""
        return any(s.client != client for s in list(self._streams.values()))

    def close(self, request_id: str) -> None:
        """Stops handing the request's chunks over (its stream is done with)."""
        self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id, None))

    def end_session(self, session_id: str) -> None:
        self._post(("end_session", session_id, None))

    async def stats(self) -> EngineStats:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._post(("stats", None, (loop, fut)))
        return await fut

    async def call(self, fn):
        """``fn(engine)`` run on the engine thread between steps (what must not race the
        step loop: the closing search, the output policy's memos); its result or error."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._post(("call", fn, (loop, fut)))
        return await fut

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._tokenizer_pool.shutdown(wait=False)

    # engine thread ----------------------------------------------------------------------

    def _post(self, msg) -> None:
        self._inbox.put(msg)
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            if not self.engine.has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug: fail what is in flight, keep serving
                logger.exception("engine step raised; failing the requests in flight")
                outputs = self.engine.fail_all(f"the engine step failed ({type(exc).__name__}: "
                                               f"{exc}); this is a bug in rayguide")
            self._deliver(outputs)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg, reply = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request, prompt_ids = arg
                try:
                    self.engine.add_request(request, prompt_ids=prompt_ids)
                    _resolve(reply, None)
                except Exception as exc:
                    self._streams.pop(request.request_id, None)
                    _resolve(reply, exc)
            elif kind == "abort":
                out = self.engine.abort(arg)
                if out is not None:
                    self._deliver([out])
            elif kind == "end_session":
                self._deliver(self.engine.end_session(arg))
            elif kind == "stats":
                try:
                    _resolve(reply, None, self.engine.stats())
                except Exception as exc:  # a bug: the caller sees it, the loop lives on
                    logger.exception("engine stats failed")
                    _resolve(reply, exc)
            elif kind == "call":
                try:
                    _resolve(reply, None, arg(self.engine))
                except Exception as exc:  # the caller's to handle; the loop lives on
                    _resolve(reply, exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hands a step's outputs over: one call per event loop, not one per chunk (each
        call wakes the loop's thread, which then competes with this one for the GIL)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_hand_over, batch)


class _Stream:
    """One request's chunks on its consumer's event loop: what the engine produced since
    the consumer last took (merged into one chunk), and the consumer's wait."""

    __slots__ = ("loop", "client", "pending", "waiter", "on_ready")

    def __init__(self, loop: asyncio.AbstractEventLoop, client=None):
        self.loop = loop
        self.client = client  # whose request it is (GenerationRequest.client)
        self.pending: RequestOutput | None = None
        self.waiter: asyncio.Future | None = None
        self.on_ready = None  # called when the stream goes from nothing to a chunk

    def put(self, out: RequestOutput) -> None:
        if self.pending is None:
            self.pending = out  # a fresh object from the engine: ours to merge into
            if self.on_ready is not None:
                self.on_ready()
        else:
            self.pending.merge(out)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self) -> RequestOutput:
        """Everything gained since the last take, as one chunk; waits while nothing is."""
        while self.pending is None:
            self.waiter = self.loop.create_future()
            await self.waiter
        out, self.pending = self.pending, None
        return out

    def take_now(self) -> RequestOutput | None:
        """What was gained since the last take, or None."""
        out, self.pending = self.pending, None
        return out


def _hand_over(batch: list) -> None:
    for stream, out in batch:
        stream.put(out)


def _resolve(reply, exc: BaseException | None, value=None) -> None:
    loop, fut = reply

    def settle():
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    loop.call_soon_threadsafe(settle)
