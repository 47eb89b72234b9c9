"""Runs one scheduled step through the model: builds the flat token batch, owns the KV
cache tensors, and returns the logits of the rows that sample.

On the CPU (and on a device without Triton) the batch is built as ``AttentionBatch.build``
describes; a row of at most ``DECODE_ROW_TOKENS`` tokens (a decode, jump-forward's forced
text, a speculative draft) goes in as that many decode rows, each token attending to its
own context in place, so only a prompt's long chunks take the prefill path. On a GPU the step's whole description (token ids, positions, cache slots, block
tables, attention tiles, the sampled rows) is packed on the host into one int32 tensor and
crosses to the device in one copy (``_tiled_batch``); the model's layers then take the
device kernels (worker/models/triton_kernels.py). A decode-only step there replays a CUDA
graph of the same forward (worker/engine/cuda_graphs.py) where graphs are on.
"""

from __future__ import annotations

import math
import mmap

import torch

from worker.engine.cuda_graphs import DecodeGraphs
from worker.engine.scheduler import ScheduledSeq
from worker.models import triton_kernels
from worker.models.llama import LlamaForCausalLM
from worker.models.paged_attention import AttentionBatch
from worker.models.triton_kernels import AttentionTiles

# on the CPU path, a row of at most this many tokens attends as that many decode rows
DECODE_ROW_TOKENS = 16

# query tokens per prefill tile of the attention kernel (a tile also spans the query
# heads that share one KV head)
PREFILL_TILE_TOKENS = 16


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU, fresh anonymous memory (the kernel hands out zero pages
    on first touch), so a KV cache costs neither the time to zero it nor resident memory
    beyond the blocks written: 1 GB by torch.zeros was 0.4 s of CPU at every worker start."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # the tensor holds the mapping: it is unmapped when the last tensor over it is freed
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def kv_bytes_per_token(model: LlamaForCausalLM, dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * len(model.layers) * model.num_kv_heads * model.head_dim * elem


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 tiled: bool | None = None):
        """``tiled``: take the device kernels' path (None: on any device but the CPU, where
        Triton is installed and the model supports it)."""
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if tiled is None:
            tiled = (self.device.type != "cpu" and triton_kernels.available()
                     and model.supports_tiled_attention)
        self.tiled = tiled
        # one block more than the block manager hands out: the scratch slots a CUDA graph's
        # padding rows write their key and value to
        self.scratch_slot = num_blocks * block_size
        self.graphs: DecodeGraphs | None = None
        shape = ((num_blocks + 1) * block_size, model.num_kv_heads, model.head_dim)
        # per layer: (K, V), each [num_slots, Hkv, D]
        self.kv_caches = [(zeroed(shape, self.dtype, self.device),
                           zeroed(shape, self.dtype, self.device)) for _ in model.layers]

    def enable_graphs(self, max_rows: int, max_model_len: int, capture: bool = True) -> None:
        """Decode steps of up to ``max_rows`` rows replay CUDA graphs (recorded now, on
        CUDA); ``capture=False`` runs the same static-buffer path eagerly (tests)."""
        assert self.tiled, "CUDA graphs record the tiled path"
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_rows,
                                   -(-max_model_len // self.block_size), self.scratch_slot,
                                   capture)
        self.graphs.record()

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int]]:
        """Returns (logits [R, V] fp32, indices into ``scheduled`` of the sampling rows).
        A sequence samples when this step computes its last pending token; it has
        ``num_logits`` rows of logits in turn (a draft's positions; else one)."""
        if self.graphs is not None and self.graphs.fits(scheduled):
            return self.graphs.run(scheduled)
        if self.tiled:
            input_ids, batch, rows, sample_idx = self._tiled_batch(scheduled)
            hidden = self.model(input_ids, batch.positions, self.kv_caches, batch)
            return self.model.compute_logits(hidden.index_select(0, rows)), sample_idx
        tokens: list[int] = []
        positions: list[int] = []
        decodes, prefills, last = [], [], {}
        # a row of a few tokens (a decode, forced text, a draft) goes in as that many
        # decode rows, each token its own query over its context read in place (its own
        # and the row's earlier keys written first); such rows come first in the batch
        order = sorted(range(len(scheduled)),
                       key=lambda i: scheduled[i].num_tokens > DECODE_ROW_TOKENS)
        for i in order:
            s = scheduled[i]
            seq, n = s.seq, s.num_tokens
            start = seq.num_computed
            tokens.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            if n <= DECODE_ROW_TOKENS:
                decodes.extend((seq.block_table, p + 1) for p in range(start, start + n))
            else:
                prefills.append((seq.block_table, start + n, n))
            last[i] = len(tokens)
        sample_rows, sample_idx = [], []
        for i, s in enumerate(scheduled):
            if s.samples:  # the logits after its last token (after each, for a draft)
                sample_rows.extend(range(last[i] - s.num_logits, last[i]))
                sample_idx.append(i)
        batch = AttentionBatch.build(decodes, prefills, self.block_size, self.device)
        hidden = self.model(
            torch.tensor(tokens, device=self.device),
            torch.tensor(positions, device=self.device),
            self.kv_caches,
            batch,
        )
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        return logits, sample_idx

    def _tiled_batch(self, scheduled: list[ScheduledSeq]):
        """(input ids [T], AttentionBatch with tiles, sampled rows [R], their indices into
        ``scheduled``), every tensor a view of one int32 buffer copied to the device once.

        Layout: tokens [T] | positions [T] | slots [T] | sampled rows [R] | decode tiles
        [Nd, 4] | prefill tiles [Np, 4] | block tables [S, max_blocks]."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        sample_idx: list[int] = []
        decode_tiles: list[int] = []
        prefill_tiles: list[int] = []
        tables: list[list[int]] = []
        max_ctx = 0
        for i, s in enumerate(scheduled):
            seq, n = s.seq, s.num_tokens
            start, table = seq.num_computed, seq.block_table
            first = len(tokens)
            tokens += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            ctx = start + n
            max_ctx = max(max_ctx, ctx)
            tables.append(table[:-(-ctx // bs)])
            if n == 1:
                decode_tiles += (i, first, 1, start)
            else:
                for j in range(0, n, PREFILL_TILE_TOKENS):
                    prefill_tiles += (i, first + j, min(PREFILL_TILE_TOKENS, n - j), start + j)
            if s.samples:
                rows.extend(range(first + n - s.num_logits, first + n))
                sample_idx.append(i)
        width = max(len(t) for t in tables)
        flat_tables = [b for t in tables for b in (t + [0] * (width - len(t)))]
        t_len, r_len = len(tokens), len(rows)
        host = torch.tensor(tokens + positions + slots + rows + decode_tiles + prefill_tiles
                            + flat_tables, dtype=torch.int32)
        if self.device.type == "cuda":
            host = host.pin_memory()
        buf = host.to(self.device, non_blocking=True)  # the step's one host-to-device copy
        at = 0

        def take(n):
            nonlocal at
            at += n
            return buf[at - n:at]

        input_ids, pos, slot, sampled = take(t_len), take(t_len), take(t_len), take(r_len)
        dec = take(len(decode_tiles)).view(-1, 4)
        pre = take(len(prefill_tiles)).view(-1, 4)
        block_tables = take(len(flat_tables)).view(len(tables), width)
        tiles = []
        if decode_tiles:
            tiles.append(AttentionTiles(dec, block_tables, 1, max_ctx))
        if prefill_tiles:
            tiles.append(AttentionTiles(pre, block_tables, PREFILL_TILE_TOKENS, max_ctx))
        batch = AttentionBatch(slot_mapping=slot, block_size=bs, positions=pos, tiles=tiles)
        return input_ids, batch, sampled, sample_idx
