"""What the edge remembers of the 429s it answered: a client told to retry after ``r``
seconds (its checks refused by the worker's compile queue: ``overloaded``) that asks again
sooner is answered 429 at once, from here, without the schema's preparation (milliseconds
of the replica's CPU for a large schema, on the event loop that every other client's
requests share), a route, or a call to a worker. A flood that ignores ``Retry-After``
then costs the edge little more than reading its bodies (issue 58, item 1)."""

from __future__ import annotations

import time
from collections import OrderedDict


class Refusals:
    """client -> the monotonic time before which its next ask is refused; at most
    ``max_clients`` kept (the oldest go first: a forgotten client is only asked again)."""

    def __init__(self, max_clients: int = 4096, clock=time.monotonic):
        self.max_clients = max_clients
        self.clock = clock
        self.answered = 0  # asks refused from here
        self._until: OrderedDict[str, float] = OrderedDict()

    def refused(self, client: str | None, retry_after: str | None) -> None:
        """The runtime refused ``client``'s ask with this ``Retry-After`` (seconds)."""
        try:
            wait = float(retry_after or 0)
        except ValueError:
            return
        if client is None or wait <= 0:
            return
        self._until[client] = self.clock() + min(wait, 60.0)
        self._until.move_to_end(client)
        while len(self._until) > self.max_clients:
            self._until.popitem(last=False)

    def wait_left(self, client: str | None) -> float:
        """Seconds before ``client`` may ask again (0: now)."""
        until = self._until.get(client) if client is not None else None
        if until is None:
            return 0.0
        left = until - self.clock()
        if left <= 0:
            del self._until[client]
            return 0.0
        self.answered += 1
        return left
