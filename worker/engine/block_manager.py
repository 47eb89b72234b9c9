"""Paged KV-cache bookkeeping: which blocks are free, which sequence or session owns which.

Blocks are plain integers into the cache tensors (see ``worker/engine/kv_cache.py``). A
block has exactly one owner at a time (a running sequence or an idle session), so no
reference counts are needed; a session's blocks move to its next turn's sequence.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class SessionKV:
    """KV kept for an idle session: ``token_ids`` have their KV in ``blocks``."""

    token_ids: list[int]
    blocks: list[int]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        # idle sessions, least recently used first
        self.sessions: OrderedDict[str, SessionKV] = OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_session_blocks(self) -> int:
        return sum(len(s.blocks) for s in self.sessions.values())

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extends ``table`` to hold ``num_tokens``; evicts idle sessions (LRU) if needed.
        Returns False, changing nothing, when even that cannot make room."""
        need = blocks_for(num_tokens, self.block_size) - len(table)
        if need <= 0:
            return True
        while need > len(self._free) and self.sessions:
            self.evict_oldest_session()
        if need > len(self._free):
            return False
        table.extend(self._free.popleft() for _ in range(need))
        return True

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
        blocks.clear()

    # sessions ---------------------------------------------------------------------------

    def keep_session(self, session_id: str, token_ids: list[int], blocks: list[int]) -> None:
        """Parks a finished turn's KV for the session's next turn (replacing older KV)."""
        self.drop_session(session_id)
        keep = blocks_for(len(token_ids), self.block_size)
        self.free(blocks[keep:])
        self.sessions[session_id] = SessionKV(list(token_ids), blocks[:keep])

    def take_session(self, session_id: str, prompt_ids: list[int]) -> tuple[list[int], int]:
        """Hands a session's KV to its next turn: returns (block table, number of prompt
        tokens whose KV is reused). At least one prompt token is left to compute, so the
        step that finishes the prompt has logits to sample from."""
        kv = self.sessions.pop(session_id, None)
        if kv is None:
            return [], 0
        common = 0
        limit = min(len(kv.token_ids), len(prompt_ids) - 1)
        while common < limit and kv.token_ids[common] == prompt_ids[common]:
            common += 1
        keep = blocks_for(common, self.block_size)
        table = kv.blocks[:keep]
        self.free(kv.blocks[keep:])
        return table, common

    def drop_session(self, session_id: str) -> bool:
        kv = self.sessions.pop(session_id, None)
        if kv is not None:
            self.free(kv.blocks)
        return kv is not None

    def evict_oldest_session(self) -> str:
        session_id, kv = self.sessions.popitem(last=False)
        self.free(kv.blocks)
        return session_id
