"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget. Running sequences go first, in arrival order (a decoding
sequence costs 1 token, a sequence still prefilling costs its next chunk); then waiting
sequences are admitted while budget, sequence slots and KV blocks last, so prefill and
decode share a step and a long prompt is prefilled in chunks. When a running sequence
needs a block and none is free, idle sessions are evicted first, then the newest running
sequence is preempted: its blocks are freed and it waits to be recomputed (never an error);
no sequence is admitted in a step that had to preempt. A sequence is admitted after the
longest prefix of its tokens the KV cache already holds (``BlockManager.lookup``), or not at
all (the blocks it found go back when the rest does not fit).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from worker.engine.block_manager import BlockManager, blocks_for
from worker.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens computed for it this step
    num_logits: int = 1  # logits it needs when it samples: its last ones (a draft's: more)

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1

    @property
    def samples(self) -> bool:
        """This step computes the sequence's last pending token, so it samples."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.token_ids)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # running sequences held out of the batch (their blocks kept) while their guided
        # part waits for a search (worker/guided/search_slices.py)
        self.parked: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def park(self, seq: Sequence) -> None:
        """Holds a running sequence out of the batch, its blocks kept, until ``unpark``."""
        self.running.remove(seq)
        seq.status = SeqStatus.PARKED
        self.parked.append(seq)

    def unpark(self, seq: Sequence) -> None:
        self.parked.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def schedule(self) -> list[ScheduledSeq]:
        """Returns this step's sequences: single-token (decode) ones first, then chunks."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preemptions = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending, budget)
            while not self.blocks.grow(seq.block_table, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        # the prompt blocks this step computes: a prompt that goes on with one of them
        # waits a step and finds it cached, rather than computing it beside
        computing = set()
        if self.blocks.prefix_caching:
            for s in scheduled:
                self._computing(s.seq, s.num_tokens, computing)
        # after a preemption the cache is full: admitting would only thrash
        while (self.waiting and budget > 0
               and len(self.running) + len(self.parked) < self.max_num_seqs
               and self.num_preemptions == preemptions):
            seq = self.waiting[0]
            if self._lookup(seq) in computing:
                self._release(seq)
                break
            n = min(seq.num_pending, budget)
            if not self.blocks.grow(seq.block_table, seq.num_computed + n):
                self._release(seq)  # all or nothing: a waiting sequence holds no block
                break
            if not seq.looked_up:
                seq.looked_up = True
                seq.cached_tokens = min(seq.num_computed, seq.num_prompt)
                self.blocks.count_lookup(len(seq.token_ids), seq.num_computed)
            if self.blocks.prefix_caching:
                self._computing(seq, n, computing)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        scheduled.sort(key=lambda s: not s.is_decode)
        return scheduled

    def _lookup(self, seq: Sequence) -> bytes | None:
        """A sequence about to be admitted starts after the longest cached prefix of its
        tokens (worker/engine/block_manager.py); returns the key of its first block not
        cached. ``cached_tokens`` reports its first admission's (a preempted sequence
        finding its own blocks again is no cache hit for the caller)."""
        seq.block_table, seq.block_keys, missed = self.blocks.lookup(
            seq.token_ids, seq.cache_scope, session=seq.session_id is not None)
        seq.num_computed = len(seq.block_table) * self.blocks.block_size
        if seq.session_id is not None:
            self.blocks.touch_session(seq.session_id)
        return missed

    def _computing(self, seq: Sequence, n: int, keys: set) -> None:
        """Adds to ``keys`` those of the prompt's full blocks this step computes for it."""
        if seq.num_computed < seq.num_prompt:
            keys.update(self.blocks.keys_after(
                seq.block_keys, seq.token_ids, min(seq.num_computed + n, seq.num_prompt),
                seq.cache_scope))

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.block_keys = []
        seq.num_computed = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def remove(self, seq: Sequence) -> None:
        """Takes a sequence out of the queues (finished, aborted or failed)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.PARKED:
            self.parked.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def can_ever_fit(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.blocks.block_size) <= self.blocks.num_blocks
