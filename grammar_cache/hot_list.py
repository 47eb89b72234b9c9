"""HotList: the grammars every worker of a tokenizer should hold (warm replication), and the
demand that decides it, bounded. No Ray: the cache actor (grammar_cache/actor.py) keeps one.

A grammar is tracked (its spec, the requests workers reported for it, when it was last asked
for) from its first ask; requested ``replicate_after_requests`` times it joins its
tokenizer's hot list, which workers read through a cursor. Tracking is bounded: at most
``max_tracked_grammars`` grammars (the least recently asked for is forgotten first), and a
grammar nobody asked for in ``hot_idle_s`` is forgotten; a forgotten grammar leaves the hot
list (workers that hold it keep it in their own bounded LRU; a new worker is not sent it)
and starts from zero requests if asked for again. Grammars listed in ``hot_specs`` are
pinned: hot from the start, never forgotten.

The cursor is a sequence number per tokenizer, not a position, so forgetting an entry never
makes a worker skip or repeat one: ``since(fp, cursor)`` returns the hot grammars added at
or after ``cursor`` that are still hot, and the cursor to ask with next.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from grammar_cache.config import GrammarCacheConfig
from core.grammar_spec import GrammarSpec


@dataclass
class _Tracked:
    spec: GrammarSpec | None
    requests: int = 0
    last: float = 0.0


class HotList:
    def __init__(self, config: GrammarCacheConfig, clock: Callable[[], float] = time.monotonic):
        self.replicate = config.replicate
        self.after = config.replicate_after_requests
        self.max_tracked = config.max_tracked_grammars
        self.idle_s = config.hot_idle_s
        self.clock = clock
        self._tracked: OrderedDict[str, _Tracked] = OrderedDict()  # least recent first
        self._pinned: dict[str, GrammarSpec] = {}
        self._hot: dict[str, OrderedDict[str, int]] = {}  # fp -> key -> sequence number
        self._next: dict[str, int] = {}  # fp -> the next sequence number (the cursor)
        self._hot_fp: dict[str, str] = {}  # key -> its tokenizer's fingerprint
        self.forgotten = 0

    def seen(self, key: str, spec: GrammarSpec) -> None:
        """A request asked the cache for ``key``."""
        entry = self._touch(key)
        if entry.spec is None:
            entry.spec = spec

    def use(self, fingerprint: str, key: str, requests: int,
            spec: GrammarSpec | None) -> bool:
        """A worker's report of ``requests`` for ``key`` (``spec`` None when it sent it
        before). True when the grammar joined the hot list now."""
        entry = self._touch(key)
        if spec is not None and entry.spec is None:
            entry.spec = spec
        entry.requests += requests
        if self.replicate and entry.spec is not None and entry.requests >= self.after:
            return self._add(fingerprint, key)
        return False

    def pin(self, fingerprint: str, key: str, spec: GrammarSpec) -> bool:
        """A configured hot grammar: hot now and never forgotten. True when newly hot."""
        self._pinned[key] = spec
        return self._add(fingerprint, key)

    def since(self, fingerprint: str, cursor: int) -> tuple[int, list[tuple[str, GrammarSpec]]]:
        """The cursor to ask with next, and the hot (key, spec) pairs added at or after
        ``cursor``; from 0 (a new worker) every hot grammar, most requested first."""
        self._forget_idle()
        hot = self._hot.get(fingerprint, {})
        new = [k for k, seq in hot.items() if seq >= cursor]
        if cursor == 0:
            new.sort(key=lambda k: -self.requests(k))
        return self._next.get(fingerprint, 0), [(k, self.spec(k)) for k in new]

    def spec(self, key: str) -> GrammarSpec | None:
        if key in self._pinned:
            return self._pinned[key]
        entry = self._tracked.get(key)
        return entry.spec if entry is not None else None

    def requests(self, key: str) -> int:
        entry = self._tracked.get(key)
        return entry.requests if entry is not None else 0

    def __len__(self) -> int:
        """Grammars tracked (pinned ones not counted)."""
        return len(self._tracked)

    def hot_count(self, fingerprint: str) -> int:
        return len(self._hot.get(fingerprint, {}))

    def _touch(self, key: str) -> _Tracked:
        entry = self._tracked.get(key)
        if entry is None:
            entry = self._tracked[key] = _Tracked(None)
        else:
            self._tracked.move_to_end(key)
        entry.last = self.clock()
        self._forget_idle()
        while len(self._tracked) > self.max_tracked:
            self._forget(next(iter(self._tracked)))
        return entry

    def _forget_idle(self) -> None:
        limit = self.clock() - self.idle_s
        while self._tracked:
            key, entry = next(iter(self._tracked.items()))
            if entry.last >= limit:
                break
            self._forget(key)

    def _forget(self, key: str) -> None:
        del self._tracked[key]
        self.forgotten += 1
        if key in self._pinned:
            return
        fp = self._hot_fp.pop(key, None)
        if fp is not None:
            del self._hot[fp][key]

    def _add(self, fingerprint: str, key: str) -> bool:
        hot = self._hot.setdefault(fingerprint, OrderedDict())
        if key in hot:
            return False
        seq = self._next.get(fingerprint, 0)
        hot[key] = seq
        self._next[fingerprint] = seq + 1
        self._hot_fp[key] = fingerprint
        return True
