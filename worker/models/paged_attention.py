"""Attention over a paged KV cache, in plain PyTorch.

The KV cache is split into fixed-size blocks; a sequence owns a list of blocks (its block
table) and each of its tokens lives in one *slot* (``block_id * block_size + offset``).
One engine step runs a flat batch of tokens through the model: first the decode rows (one
token each; a sequence's few new tokens, as forced text or a draft, are that many decode
rows, each with its own context length), then a chunk of tokens for every sequence that is
(pre)filling. Linear
layers see all tokens at once; only attention is split:

- decode rows: on x86-64 CPUs with AVX2, one C kernel (kernels/paged_attention_cpu.c)
  reads each row's context in place through its block table; elsewhere (CUDA, other
  CPUs, no C compiler) their context blocks are gathered into one padded tensor and a
  single SDPA call with a length mask serves them all;
- each prefill chunk runs its own SDPA call (there are few of them per step), causal, with
  an offset when the chunk continues earlier context (chunked prefill, session reuse).

On a GPU with Triton the model takes the tiled path instead (``AttentionBatch.tiles``,
built by ``ModelRunner`` in one host-to-device copy): each layer writes its new keys and
values into the cache as it applies RoPE, and one kernel per launch attends decode rows and
prefill chunks alike from the cache in place (worker/models/triton_kernels.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from worker.models import native
from worker.models.triton_kernels import AttentionTiles


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens inside the flat batch.

    ``start:end`` indexes the batch's token axis; ``context_len`` counts the tokens of the
    sequence whose KV is in the cache after this step (earlier context + this chunk);
    ``context_blocks`` ([ceil(context_len / block_size)] int64) is its block table.
    """

    start: int
    end: int
    context_len: int
    context_blocks: torch.Tensor | None  # None when the chunk is the whole context

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class AttentionBatch:
    """How the flat token batch of one step maps onto sequences and cache slots.

    slot_mapping: [num_tokens] int64, cache slot (block * block_size + offset) that each
        token's K/V is written to.
    num_decode: the first ``num_decode`` tokens are single decode tokens, one per sequence.
    decode_blocks: [num_decode, max_blocks] int64 block tables (padded with block 0).
    decode_mask: [num_decode, 1, 1, max_blocks * block_size] bool, True on real context.
    decode_lens: [num_decode] int64 context lengths (on the CPU, for the decode kernel).
    prefills: chunks for the remaining tokens, in batch order.
    """

    slot_mapping: torch.Tensor
    block_size: int
    num_decode: int = 0
    decode_blocks: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # gather buffers for the decode rows, made by the first layer and reused by the others
    # (a fresh multi-MB tensor per layer costs page faults that dominate the gather)
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None
    # the tiled path (device kernels): [T] positions and the launches' tiles (decode tiles
    # of one token, then prefill tiles); empty on the path above
    positions: torch.Tensor | None = None
    tiles: list[AttentionTiles] = field(default_factory=list)

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
        decode_blocks = decode_mask = decode_lens = None
        if decodes:
            max_blocks = max(-(-n // block_size) for _, n in decodes)
            decode_blocks = torch.zeros(len(decodes), max_blocks, dtype=torch.int64)
            for i, (table, n) in enumerate(decodes):
                used = -(-n // block_size)
                decode_blocks[i, :used] = torch.tensor(table[:used], dtype=torch.int64)
            lens = decode_lens = torch.tensor([n for _, n in decodes], dtype=torch.int64)
            decode_mask = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]
            decode_blocks = decode_blocks.to(device)
            decode_mask = decode_mask[:, None, None, :].to(device)
        chunks = []
        pos = len(decodes)
        for table, ctx, n_new in prefills:
            slot_mapping.extend(slot(table, i) for i in range(ctx - n_new, ctx))
            blocks = None
            if n_new != ctx:
                used = -(-ctx // block_size)
                blocks = torch.tensor(table[:used], dtype=torch.int64, device=device)
            chunks.append(PrefillChunk(pos, pos + n_new, ctx, blocks))
            pos += n_new
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            block_size=block_size,
            num_decode=len(decodes),
            decode_blocks=decode_blocks,
            decode_mask=decode_mask,
            decode_lens=decode_lens,
            prefills=chunks,
        )


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
    k_cache, v_cache: [num_slots, Hkv, D] (num_slots = num_blocks * block_size).
    Returns [T, Hq, D]. Query head h reads KV head h // (Hq / Hkv), as in HF Llama.
    """
    k_cache.index_copy_(0, batch.slot_mapping, k)
    v_cache.index_copy_(0, batch.slot_mapping, v)
    out = torch.empty_like(q)
    num_q, num_kv, dim = q.shape[1], k.shape[1], q.shape[2]
    group = num_q // num_kv
    bs = batch.block_size
    k_blocks = k_cache.view(-1, bs, num_kv, dim)  # [num_blocks, bs, Hkv, D]
    v_blocks = v_cache.view(-1, bs, num_kv, dim)
    nd = batch.num_decode
    if nd and _decode_in_place(q, k_cache, v_cache, batch, out, scale):
        nd = 0  # done by the kernel
    if nd:
        # Whole blocks are copied (one memcpy each), then viewed as [nd, Hkv, L, D]; the
        # query heads of one KV head ride as G query rows, so K/V are never repeated.
        idx = batch.decode_blocks.flatten()
        if batch.scratch is None:
            shape = (idx.numel(), bs, num_kv, dim)
            batch.scratch = (k_cache.new_empty(shape), v_cache.new_empty(shape))
        kbuf, vbuf = batch.scratch
        torch.index_select(k_blocks, 0, idx, out=kbuf)
        torch.index_select(v_blocks, 0, idx, out=vbuf)
        ks = kbuf.view(nd, -1, num_kv, dim).transpose(1, 2)  # [nd, Hkv, L, D]
        vs = vbuf.view(nd, -1, num_kv, dim).transpose(1, 2)
        qd = q[:nd].view(nd, num_kv, group, dim)
        o = F.scaled_dot_product_attention(qd, ks, vs, attn_mask=batch.decode_mask, scale=scale)
        out[:nd] = o.reshape(nd, num_q, dim)
    for chunk in batch.prefills:
        n, ctx = chunk.num_tokens, chunk.context_len
        qc = q[chunk.start:chunk.end].transpose(0, 1)  # [Hq, n, D]
        if chunk.context_blocks is None:
            kc = k[chunk.start:chunk.end].transpose(0, 1)  # [Hkv, n, D]
            vc = v[chunk.start:chunk.end].transpose(0, 1)
            mask, causal = None, True
        else:
            kc = k_blocks.index_select(0, chunk.context_blocks).view(-1, num_kv, dim)[:ctx]
            vc = v_blocks.index_select(0, chunk.context_blocks).view(-1, num_kv, dim)[:ctx]
            kc, vc = kc.transpose(0, 1), vc.transpose(0, 1)
            # Token i of the chunk sits at position ctx - n + i and sees keys 0..that position.
            rows = torch.arange(n, device=q.device)[:, None] + (ctx - n)
            mask, causal = torch.arange(ctx, device=q.device)[None, :] <= rows, False
        # 4-D: with 3-D inputs the CPU takes SDPA's math path instead of its fused kernel
        # (3-6x slower; an 8k-token prompt's prefill took minutes on two cores)
        o = F.scaled_dot_product_attention(qc[None], kc[None], vc[None], attn_mask=mask,
                                           is_causal=causal, scale=scale, enable_gqa=group > 1)
        out[chunk.start:chunk.end] = o[0].transpose(0, 1)
    return out


# --- the CPU decode kernel ---------------------------------------------------------------

def _bind(lib: ctypes.CDLL):
    fn = lib.paged_decode_attention_f32
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, p, p, p, i64, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                   i64]
    fn.restype = ctypes.c_int
    return fn


# the C decode kernel, built on first use; None where it cannot be (see native)
_decode_kernel = native.LazyKernel(native.KERNELS / "paged_attention_cpu.c", _bind,
                                   "decode rows gather their KV blocks (slower)")


def decode_kernel_available() -> bool:
    """Builds / loads the kernel now; whether CPU decode rows use it."""
    return _decode_kernel() is not None


def _decode_in_place(q, k_cache, v_cache, batch: AttentionBatch, out, scale: float) -> bool:
    """Decode rows through the C kernel (their output written into ``out[:nd]``); False
    where it does not apply (not fp32 on the CPU, a head size not a multiple of 8, no
    kernel), and the caller takes the torch path."""
    if (q.device.type != "cpu" or q.dtype != torch.float32 or k_cache.dtype != torch.float32
            or q.shape[2] % 8 or batch.decode_lens is None):
        return False
    fn = _decode_kernel()
    if fn is None:
        return False
    nd, num_q, dim = batch.num_decode, q.shape[1], q.shape[2]
    qd = q[:nd]
    if qd.stride(2) != 1 or qd.stride(1) != dim:
        qd = qd.contiguous()
    tables = batch.decode_blocks.contiguous()
    failed = fn(qd.data_ptr(), qd.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                tables.data_ptr(), tables.shape[1], batch.decode_lens.data_ptr(),
                out.data_ptr(), out.stride(0), nd, num_q, k_cache.shape[1], dim,
                batch.block_size, scale, torch.get_num_threads())
    return failed == 0
