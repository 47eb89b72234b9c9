"""Attention over a paged KV cache, in plain PyTorch.

The KV cache is split into fixed-size blocks; a sequence owns a list of blocks (its block
table) and each of its tokens lives in one *slot* (``block_id * block_size + offset``).
One engine step runs a flat batch of tokens through the model: first one token for every
decoding sequence, then a chunk of tokens for every sequence that is (pre)filling. Linear
layers see all tokens at once; only attention is split:

- decode rows are batched: their context slots are gathered into one padded tensor and a
  single SDPA call with a length mask serves them all;
- each prefill chunk runs its own SDPA call (there are few of them per step), causal, with
  an offset when the chunk continues earlier context (chunked prefill, session reuse).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens inside the flat batch.

    ``start:end`` indexes the batch's token axis; ``context_len`` counts the tokens of the
    sequence whose KV is in the cache after this step (earlier context + this chunk);
    ``context_slots`` ([context_len] int64) are their cache slots, in position order.
    """

    start: int
    end: int
    context_len: int
    context_slots: torch.Tensor | None  # None when the chunk is the whole context

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class AttentionBatch:
    """How the flat token batch of one step maps onto sequences and cache slots.

    slot_mapping: [num_tokens] int64, cache slot that each token's K/V is written to.
    num_decode: the first ``num_decode`` tokens are single decode tokens, one per sequence.
    decode_slots: [num_decode, max_ctx] int64, context slots per decode row (padded with 0).
    decode_mask: [num_decode, 1, 1, max_ctx] bool, True where a slot is real context.
    prefills: chunks for the remaining tokens, in batch order.
    """

    slot_mapping: torch.Tensor
    num_decode: int = 0
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        decodes: list[tuple[list[int], int]],
        prefills: list[tuple[list[int], int, int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionBatch":
        """Builds the batch from block tables.

        decodes: per decoding sequence, (block table, context length including the new token).
        prefills: per prefilling sequence, (block table, context length after this step,
            number of new tokens in this chunk); the new tokens are the last ones.
        """

        def slot(table, pos):
            return table[pos // block_size] * block_size + pos % block_size

        slot_mapping = [slot(t, n - 1) for t, n in decodes]
        decode_slots = decode_mask = None
        if decodes:
            decode_slots, lens = _context_slots([t for t, _ in decodes],
                                                [n for _, n in decodes], block_size, device)
            decode_mask = torch.arange(decode_slots.shape[1], device=device)[None, :] < lens[:, None]
            decode_mask = decode_mask[:, None, None, :]
        chunks = []
        pos = len(decodes)
        for table, ctx, n_new in prefills:
            slot_mapping.extend(slot(table, i) for i in range(ctx - n_new, ctx))
            slots = None
            if n_new != ctx:
                slots = _context_slots([table], [ctx], block_size, device)[0][0]
            chunks.append(PrefillChunk(pos, pos + n_new, ctx, slots))
            pos += n_new
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            num_decode=len(decodes),
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=chunks,
        )


def _context_slots(tables, lens, block_size, device):
    """[B, max_len] slots of positions 0..len-1 of each table (padding points at slot 0)."""
    max_len = max(lens)
    max_blocks = -(-max_len // block_size)
    padded = torch.zeros(len(tables), max_blocks, dtype=torch.int64)
    for i, t in enumerate(tables):
        n = min(len(t), max_blocks)
        padded[i, :n] = torch.tensor(t[:n], dtype=torch.int64)
    offsets = torch.arange(block_size, dtype=torch.int64)
    slots = (padded[:, :, None] * block_size + offsets).view(len(tables), -1)[:, :max_len]
    lens_t = torch.tensor(lens, dtype=torch.int64)
    slots = torch.where(torch.arange(max_len)[None, :] < lens_t[:, None], slots, 0)
    return slots.to(device), lens_t.to(device)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """Writes this step's K/V into the cache, then attends every token to its context.

    q: [T, Hq, D]; k, v: [T, Hkv, D] (rotary already applied);
    k_cache, v_cache: [num_slots, Hkv, D]. Returns [T, Hq, D].
    """
    k_cache.index_copy_(0, batch.slot_mapping, k)
    v_cache.index_copy_(0, batch.slot_mapping, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    nd = batch.num_decode
    if nd:
        # [nd, Hkv, max_ctx, D] views over one gather each for K and V.
        ks = k_cache[batch.decode_slots].transpose(1, 2)
        vs = v_cache[batch.decode_slots].transpose(1, 2)
        qd = q[:nd].unsqueeze(2)  # [nd, Hq, 1, D]
        o = F.scaled_dot_product_attention(
            qd, ks, vs, attn_mask=batch.decode_mask, scale=scale, enable_gqa=gqa
        )
        out[:nd] = o.squeeze(2)
    for chunk in batch.prefills:
        qc = q[chunk.start:chunk.end].transpose(0, 1)  # [Hq, n, D]
        if chunk.context_slots is None:
            kc = k[chunk.start:chunk.end].transpose(0, 1)
            vc = v[chunk.start:chunk.end].transpose(0, 1)
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            kc = k_cache[chunk.context_slots].transpose(0, 1)  # [Hkv, ctx, D]
            vc = v_cache[chunk.context_slots].transpose(0, 1)
            n, ctx = chunk.num_tokens, chunk.context_len
            # Token i of the chunk sits at position ctx - n + i and sees keys 0..that position.
            rows = torch.arange(n, device=q.device)[:, None] + (ctx - n)
            mask = torch.arange(ctx, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)
        out[chunk.start:chunk.end] = o.transpose(0, 1)
    return out
