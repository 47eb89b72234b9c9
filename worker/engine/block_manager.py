"""Paged KV-cache bookkeeping with automatic prefix caching.

Blocks are plain integers into the cache tensors. Each block has a reference count: one
for every running sequence whose table holds it, one for every idle session that pins it.

A full block whose tokens are final (a prompt's, or a finished output's: nothing rolls
them back) is registered under a key: a digest of the previous block's key and the
block's token ids, chained from a root that names what else changes the KV (the model and
its dtype, and the request's cache scope: the tenant the front end names, so one tenant's
prompts are never another's hits). A sequence whose tokens start with registered blocks
takes them (``lookup``): its prefill starts after them, and at least one token is always
left to compute, so the step that ends the prompt has logits to sample from. The digest is
a 128-bit BLAKE2b, not Python's ``hash``: a crafted prompt must not collide with another
client's blocks and read or poison their KV.

A registered block no one references stays cached, its KV intact, on an LRU list; it is
taken for new tokens only when no free block is left (``_take``). When even that is not
enough, idle sessions are unpinned (oldest first), and only then does the scheduler preempt.

A session is a use of the same cache: when a turn ends, its full blocks are registered and
the session pins them; its next turn finds them by ``lookup`` like any prompt (an idle
session's partial last block is not kept: at most ``block_size`` tokens are computed again).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class SessionKV:
    """An idle session's pinned blocks (registered, in order: its tokens' full blocks)."""

    blocks: list[int]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True,
                 root: str = ""):
        """``root``: what else the KV depends on (the model, its dtype); keys are chained
        from it. ``prefix_caching`` off: only sessions register and look up blocks."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.root = root
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # registered block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> registered block
        # registered blocks no one references, least recently used first
        self._cached: OrderedDict[int, None] = OrderedDict()
        # idle sessions, least recently used first
        self.sessions: OrderedDict[str, SessionKV] = OrderedDict()
        # counters (worker metrics): prompt tokens looked up, of those found cached, and
        # cached blocks taken for other tokens
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take now: free ones and cached ones no one references."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Registered blocks no one references (their KV kept for a later prompt)."""
        return len(self._cached)

    @property
    def num_session_blocks(self) -> int:
        """Blocks idle sessions pin (each counted once: sessions may share a prefix)."""
        return len({b for s in self.sessions.values() for b in s.blocks})

    def refs(self, block: int) -> int:
        return self._refs[block]

    # taking and giving back ---------------------------------------------------------------

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extends ``table`` to hold ``num_tokens``; takes cached blocks no one uses, then
        unpins idle sessions (LRU), if needed. Returns False, changing nothing, when even
        that cannot make room."""
        need = blocks_for(num_tokens, self.block_size) - len(table)
        if need <= 0:
            return True
        while need > self.num_free and self.sessions:
            self.evict_oldest_session()
        if need > self.num_free:
            return False
        for _ in range(need):
            block = self._take()
            self._refs[block] = 1
            table.append(block)
        return True

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._cached.popitem(last=False)  # the least recently used
        del self._block_of[self._key_of.pop(block)]
        self.evictions += 1
        return block

    def free(self, blocks: list[int]) -> None:
        """Drops a reference to each block (and empties ``blocks``): a block no one holds
        any more is free, or cached if registered (newest in the LRU order)."""
        for block in blocks:
            self._refs[block] -= 1
            assert self._refs[block] >= 0, block
            if not self._refs[block]:
                if block in self._key_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)
        blocks.clear()

    def _hold(self, block: int) -> None:
        if not self._refs[block]:
            self._cached.pop(block, None)
        self._refs[block] += 1

    # prefix caching ---------------------------------------------------------------------

    def _key(self, previous: bytes | None, tokens: list[int], scope: str | None) -> bytes:
        h = hashlib.blake2b(digest_size=16, person=b"rayguide-kv")
        if previous is None:
            h.update(f"{self.root}\x00{scope or ''}\x00".encode("utf-8", "surrogatepass"))
        else:
            h.update(previous)
        h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
        return h.digest()

    def lookup(self, token_ids: list[int], scope: str | None, *, session: bool = False
               ) -> tuple[list[int], list[bytes], bytes | None]:
        """The registered blocks ``token_ids`` start with, each now referenced once more,
        their keys, and the key of the first full block not found (None: none is left).
        Never all of ``token_ids``: the last token is always computed. Only a session's
        turn looks up when prefix caching is off."""
        if not (self.prefix_caching or session):
            return [], [], None
        blocks, keys, key = [], [], None
        size = self.block_size
        for i in range((len(token_ids) - 1) // size):
            key = self._key(key, token_ids[i * size:(i + 1) * size], scope)
            block = self._block_of.get(key)
            if block is None:
                return blocks, keys, key
            self._hold(block)
            blocks.append(block)
            keys.append(key)
        return blocks, keys, None

    def count_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """A sequence's first admission, in the hit-rate counters."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def keys_after(self, keys: list[bytes], token_ids: list[int], num_tokens: int,
                   scope: str | None) -> list[bytes]:
        """The keys of the full blocks among the first ``num_tokens`` of ``token_ids``
        after those ``keys`` holds (the keys of its first blocks)."""
        size, out = self.block_size, []
        previous = keys[-1] if keys else None
        for i in range(len(keys), num_tokens // size):
            previous = self._key(previous, token_ids[i * size:(i + 1) * size], scope)
            out.append(previous)
        return out

    def register(self, table: list[int], keys: list[bytes], token_ids: list[int],
                 num_tokens: int, scope: str | None) -> None:
        """Registers the full blocks among the first ``num_tokens`` of ``token_ids`` (KV
        computed and final) that are not yet: ``keys`` holds the keys of the table's first
        blocks and is extended. A block whose key another block already has stays the
        sequence's own (the same KV, computed twice in one step)."""
        num_tokens = min(num_tokens, len(table) * self.block_size)
        for key in self.keys_after(keys, token_ids, num_tokens, scope):
            block = table[len(keys)]
            keys.append(key)
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key

    # sessions ---------------------------------------------------------------------------

    def keep_session(self, session_id: str, keys: list[bytes]) -> None:
        """Pins, for the session's next turn, the registered blocks of ``keys`` (a finished
        turn's full blocks, registered), replacing what it pinned before."""
        pinned = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            self._hold(block)
            pinned.append(block)
        self.drop_session(session_id)
        self.sessions[session_id] = SessionKV(pinned)

    def touch_session(self, session_id: str) -> None:
        """The session is used again: last in the eviction order."""
        if session_id in self.sessions:
            self.sessions.move_to_end(session_id)

    def drop_session(self, session_id: str) -> bool:
        kv = self.sessions.pop(session_id, None)
        if kv is not None:
            self.free(kv.blocks)
        return kv is not None

    def evict_oldest_session(self) -> str:
        session_id, kv = self.sessions.popitem(last=False)
        self.free(kv.blocks)
        return session_id

    # checks -----------------------------------------------------------------------------

    def check(self, tables: list[list[int]]) -> None:
        """Asserts the bookkeeping holds, given every live sequence's block table: each
        block is free, cached with no reference, or referenced exactly as often as tables
        and sessions hold it (tests)."""
        held = [0] * self.num_blocks
        for table in tables + [s.blocks for s in self.sessions.values()]:
            for block in table:
                held[block] += 1
        assert held == self._refs, "reference counts differ from the tables that hold them"
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free) and not free & cached
        for block in range(self.num_blocks):
            in_use = self._refs[block] > 0
            assert in_use + (block in free) + (block in cached) == 1, block
            assert (block in cached) <= (block in self._key_of), block
        assert all(self._block_of[k] == b for b, k in self._key_of.items())
        assert len(self._block_of) == len(self._key_of)
