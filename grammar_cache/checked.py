"""The checked grammars, by id: what ``POST /v1/grammars`` checked, so ``GET
/v1/grammars/{id}`` answers the same report and a request may name ``grammar_id`` instead
of repeating a large schema. A byte-bounded LRU (no Ray): the cache actor holds the
cluster's (every front end reaches it), each front end a small one of its own in front.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict

from core.grammar_spec import GrammarSpec

MAX_CHECKED_BYTES = 64 * 2**20  # the cache actor's; about 250 schemas of the 256 kB limit
class CheckedGrammars:
    def __init__(self, max_bytes: int = MAX_CHECKED_BYTES):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[GrammarSpec, dict, int]] = OrderedDict()

    def put(self, grammar_id: str, spec: GrammarSpec, report: dict) -> None:
        """Keeps (or refreshes) ``grammar_id``; the least recently used go past the bound
        (the newest always stays)."""
        size = len(spec.source.encode("utf-8", "surrogatepass")) + len(
            json.dumps(report, default=str))
        old = self._items.pop(grammar_id, None)
        if old is not None:
            self.bytes -= old[2]
        self._items[grammar_id] = (spec, report, size)
        self.bytes += size
        while self.bytes > self.max_bytes and len(self._items) > 1:
            _, (_, _, gone) = self._items.popitem(last=False)
            self.bytes -= gone

    def get(self, grammar_id: str) -> tuple[GrammarSpec, dict] | None:
        item = self._items.get(grammar_id)
        if item is None:
            return None
        self._items.move_to_end(grammar_id)
        return item[0], item[1]

    def __len__(self) -> int:
        return len(self._items)
