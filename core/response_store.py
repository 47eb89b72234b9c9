"""The conversations ``previous_response_id`` continues: a bounded store in memory, with no
Ray and no I/O. Each front-end replica keeps one (deploy/serve_app.py), and the grammar
cache actor keeps the shared one (grammar_cache/actor.py), where every replica finds a
conversation any of them stored.

What is kept, under a response's id and its owner (the tenant of the API key that made it:
another tenant's lookup finds nothing): the conversation up to and including that
response, as the chat messages the model was sent (input items, function calls and their
outputs, the answer's text and calls; not the request's ``instructions``, its tools or its
settings, and not a reasoning model's thought), for ``ttl_s`` after it was stored. Past
``max_entries`` or ``max_chars`` (the conversations' JSON length in all), the tenant that
holds the most characters loses its oldest conversation first, so one busy tenant cannot
push out everyone else's. Nothing is written to disk; a store whose process restarts
forgets.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable


@dataclass
class _Entry:
    owner: str
    messages: list[dict]
    chars: int
    expires: float


class ResponseStore:
    """``put(owner, id, messages)`` / ``get(owner, id)``; bounded by count, characters and
    age (the module's docstring says what each means)."""

    def __init__(self, ttl_s: float, max_entries: int, max_chars: int,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.max_entries, self.max_chars = ttl_s, max_entries, max_chars
        self.clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._chars: dict[str, int] = {}  # per owner
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def chars(self) -> int:
        return sum(self._chars.values())

    def put(self, owner: str, response_id: str, messages: list[dict],
            ttl_s: float | None = None) -> bool:
        """Keeps ``messages`` under ``response_id`` for ``owner`` for ``ttl_s`` (None: the
        store's own ``ttl_s``; at most that); False when one conversation alone is over
        ``max_chars`` (nothing is kept)."""
        size = len(json.dumps(messages, ensure_ascii=False))
        if size > self.max_chars or self.max_entries < 1:
            return False
        self._drop(response_id)
        self._expire()
        while self._entries and (len(self._entries) >= self.max_entries
                                 or self.chars + size > self.max_chars):
            heaviest = max(self._chars, key=self._chars.__getitem__)
            oldest = next(k for k, e in self._entries.items() if e.owner == heaviest)
            self._drop(oldest)
            self.evicted += 1
        ttl = self.ttl_s if ttl_s is None else min(ttl_s, self.ttl_s)
        self._entries[response_id] = _Entry(owner, messages, size, self.clock() + ttl)
        self._chars[owner] = self._chars.get(owner, 0) + size
        return True

    def get(self, owner: str, response_id: str) -> list[dict] | None:
        """The conversation ``owner`` stored under ``response_id``; None when there is none
        (never stored, expired, evicted, or another owner's)."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None and entry.expires <= self.clock():  # a shorter ttl_s than
            self._drop(response_id)  # the entries before it (_expire stops at those)
            return None
        if entry is None or entry.owner != owner:
            return None
        return [dict(m) for m in entry.messages]

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires > now:
                return
            self._drop(key)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._chars[entry.owner] -= entry.chars
            if not self._chars[entry.owner]:
                del self._chars[entry.owner]
