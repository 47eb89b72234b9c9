"""A front end's side of the worker channels (worker/channel.py): one per worker, read by
one task, its batches handed to each request's ``Inbox``.

An inbox keeps what its request gained since its reader last took as one merged chunk,
so a reader that lags (an SSE writer behind its client) takes several tokens at once
instead of a queue of small chunks. When the channel fails (the worker died), every
inbox on it raises that error once what arrived before it is taken: the runtime client
then continues its requests elsewhere, from the tokens they streamed.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from core.request import RequestOutput

logger = logging.getLogger(__name__)


def detach_from_request() -> None:
    """The reading task serves every request on the channel, so its call to the worker
    must not be a child of the request that happened to open it: Ray cancels a cancelled
    task's children (Serve cancels a request whose client hangs up), and the channel's
    call, with every other request's chunks on it, went with the first client that hung
    up (a 500 for each). The task's own copy of the context forgets the request's task id
    (what Ray reads to find the parent of a call from an async actor). The runtime
    client's scheduler watch is such a task too."""
    try:
        from ray._raylet import async_task_id
    except ImportError:  # pragma: no cover - Ray moved it: the channel still works
        return
    async_task_id.set(None)


class Inbox:
    """One request's chunks from its channel."""

    __slots__ = ("pending", "error", "_waiter")

    def __init__(self):
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    def put(self, out: RequestOutput) -> None:
        if self.pending is None:
            self.pending = out
        else:
            self.pending.merge(out)
        self._wake()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> RequestOutput:
        """What the request gained since the last take; raises the channel's error once
        nothing that came before it is left."""
        while self.pending is None:
            if self.error is not None:
                raise self.error
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        out, self.pending = self.pending, None
        return out


class WorkerChannel:
    """The channel to one worker (``handle``): ``open`` an inbox for a request before
    submitting it, ``close`` it when done. The reading task starts with the first inbox
    and ends with the channel's failure (``failed``: the error, then)."""

    def __init__(self, handle, worker_id: str):
        self.handle, self.worker_id = handle, worker_id
        self.channel_id = uuid.uuid4().hex
        self.inboxes: dict[str, Inbox] = {}
        self.failed: BaseException | None = None
        self.loop = asyncio.get_running_loop()  # the reader's: a client may outlive a loop
        self._reader: asyncio.Task | None = None

    def open(self, request_id: str) -> Inbox:
        inbox = self.inboxes[request_id] = Inbox()
        if self._reader is None:
            self._reader = self.loop.create_task(self._read())
        return inbox

    def close(self, request_id: str) -> None:
        self.inboxes.pop(request_id, None)

    async def _read(self) -> None:
        detach_from_request()
        try:
            async for ref in self.handle.channel.remote(self.channel_id):
                for out in await ref:
                    inbox = self.inboxes.get(out.request_id)
                    if inbox is not None:
                        inbox.put(out)
            error: BaseException = ConnectionError(
                f"worker {self.worker_id} ended its channel")
        except asyncio.CancelledError:  # the event loop ends
            self._fail(ConnectionError(f"the channel to worker {self.worker_id} was closed"))
            raise
        except Exception as exc:  # noqa: BLE001 - each request decides (failover, error)
            error = exc
        self._fail(error)

    def _fail(self, error: BaseException) -> None:
        self.failed = error
        for inbox in list(self.inboxes.values()):
            inbox.fail(error)
