"""One front end's requests on one worker, sent back together (no Ray, no engine).

A Ray streaming-generator item costs the worker process about the same whatever it holds
(the yield, Ray's report of the item, its pickle), under the same GIL as the engine
thread. One item per request per step made that cost grow with the batch: at 64 streams
it held the engine to a third of its rate. So a front end opens one channel per worker
(``WorkerActor.channel``) and submits its requests into it (``WorkerActor.submit``); each
item the channel sends is a batch: every request that gained output since the last
item, its gain merged into one chunk. A batch goes out as soon as the previous one is
sent, so a request that keeps up gets each step's token at once (a first token, a lone
stream are never held back), and while a send is under way the next steps' tokens
gather into the next batch instead of queueing up as items.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable


class Channel:
    """The streams of one front end's requests (``add``), sent as batches (``batches``)."""

    def __init__(self, channel_id: str):
        self.channel_id = channel_id
        self.streams: dict[str, tuple[object, object]] = {}  # request id -> (request, stream)
        self._ready: dict[str, None] = {}  # request ids with output, in arrival order
        self._wake: asyncio.Event | None = None

    def add(self, request, stream) -> None:
        """``stream``: the AsyncEngine's (``take_now``, ``on_ready``)."""
        rid = request.request_id
        self.streams[rid] = (request, stream)
        stream.on_ready = lambda: self._mark(rid)
        if stream.pending is not None:
            self._mark(rid)

    def _mark(self, rid: str) -> None:
        self._ready[rid] = None
        if self._wake is not None:
            self._wake.set()

    async def batches(self, close: Callable[[str], None]) -> AsyncIterator[list]:
        """Yields lists of ``(request, chunk)``, one chunk per request that gained output
        since the last list; a finished request leaves the channel (``close(request_id)``
        is called for it)."""
        self._wake = asyncio.Event()
        while True:
            if not self._ready:
                self._wake.clear()
                await self._wake.wait()
            batch = []
            for rid in list(self._ready):
                entry = self.streams.get(rid)
                if entry is None:
                    continue
                out = entry[1].take_now()
                if out is None:
                    continue
                if out.finished:
                    del self.streams[rid]
                    close(rid)
                batch.append((entry[0], out))
            self._ready.clear()
            if batch:
                yield batch

    def request_ids(self) -> list[str]:
        return list(self.streams)
