"""CUDA graphs for the decode step of the tiled (GPU) path.

A decode step of a batch-1 8B model launches a few hundred kernels whose launch cost, on
the host, exceeds the time the GPU needs to run them. A CUDA graph records one step's
launches once and replays them with one call. A graph replays on the very tensors it
recorded, so everything a step varies lives in static device buffers that each step
overwrites (one host-to-device copy, as the eager path): the token ids, positions, KV-cache
slots, attention tiles and block tables of up to ``size`` rows, ``size`` one of a few
buckets (1, 2, 4, 8, 16, 24, 32, 48, 64, then every 32 up to ``max_num_seqs``). A step of
``b`` decode rows replays the smallest bucket that holds them; the rows beyond ``b`` are
padding that changes nothing: their attention tile has no token (the kernel skips it),
and their key and value land in a scratch slot no sequence owns (``scratch_slot``, one
block past the block manager's). Prefill and mixed steps run eagerly.

The block table width is fixed at the longest context (``max_model_len`` in blocks);
entries past a row's context are never read, so a step writes only each row's own blocks.

Without CUDA (tests), ``capture=False`` keeps everything but the recording: the same static
buffers, padding and bucket choice, the forward run eagerly on them
(tests/engine/test_cuda_graphs.py holds its greedy output equal to the eager runner's).
"""

from __future__ import annotations

import numpy as np
import torch

from worker.models.paged_attention import AttentionBatch
from worker.models.triton_kernels import AttentionTiles

FIRST_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def bucket_sizes(max_rows: int) -> list[int]:
    """The batch sizes a graph is recorded at, the last one ``max_rows``."""
    sizes = [b for b in FIRST_BUCKETS if b < max_rows]
    nxt = 96
    while nxt < max_rows:
        sizes.append(nxt)
        nxt += 32
    return sizes + [max_rows]


class DecodeGraphs:
    def __init__(self, model, kv_caches, block_size: int, max_rows: int, max_blocks: int,
                 scratch_slot: int, capture: bool):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.sizes = bucket_sizes(max_rows)
        self.max_rows, self.max_blocks, self.scratch_slot = max_rows, max_blocks, scratch_slot
        self.capture = capture
        device = next(model.parameters()).device
        m = max_rows
        # layout: tokens [m] | positions [m] | slots [m] | tiles [m, 4] | tables [m, mb]
        self._off = {"tokens": 0, "positions": m, "slots": 2 * m, "tiles": 3 * m,
                     "tables": 7 * m}
        total = 7 * m + m * max_blocks
        host = torch.zeros(total, dtype=torch.int32)
        self.host = host.pin_memory() if device.type == "cuda" else host
        self._np = self.host.numpy()
        self.static = torch.zeros(total, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.pool = None
        self.memory_bytes = 0  # what the recorded graphs hold (CUDA only)

    # --- the static buffers -------------------------------------------------------------

    def _inputs(self, size: int):
        s, o, m = self.static, self._off, self.max_rows
        ids = s[o["tokens"]:o["tokens"] + size]
        pos = s[o["positions"]:o["positions"] + size]
        slots = s[o["slots"]:o["slots"] + size]
        tiles = s[o["tiles"]:o["tiles"] + 4 * m].view(m, 4)[:size]
        tables = s[o["tables"]:].view(m, self.max_blocks)
        batch = AttentionBatch(slot_mapping=slots, block_size=self.block_size, positions=pos,
                               tiles=[AttentionTiles(tiles, tables, 1, 0)])
        return ids, pos, batch

    def _forward(self, size: int) -> torch.Tensor:
        ids, pos, batch = self._inputs(size)
        hidden = self.model(ids, pos, self.kv_caches, batch)
        return self.model.compute_logits(hidden)

    def _pad(self, first: int, size: int) -> None:
        """Rows first..size-1 of the host buffer as padding (no token, the scratch slot)."""
        a, o = self._np, self._off
        if first >= size:
            return
        a[o["tokens"] + first:o["tokens"] + size] = 0
        a[o["positions"] + first:o["positions"] + size] = 0
        a[o["slots"] + first:o["slots"] + size] = self.scratch_slot
        tiles = a[o["tiles"]:o["tiles"] + 4 * self.max_rows].reshape(self.max_rows, 4)
        tiles[first:size] = 0
        tiles[first:size, 1] = np.arange(first, size)

    # --- recording ----------------------------------------------------------------------

    @torch.inference_mode()
    def record(self) -> None:
        """Records one graph per bucket, largest first (they share one memory pool, so the
        smaller ones reuse its blocks). Without ``capture``, nothing to record."""
        if not self.capture:
            return
        self._pad(0, self.max_rows)
        self.static.copy_(self.host)
        free_before = torch.cuda.mem_get_info()[0]
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                for _ in range(2):  # compile every kernel, settle allocations
                    self._forward(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    out = self._forward(size)
                self.graphs[size] = (graph, out)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])

    # --- a step -------------------------------------------------------------------------

    def fits(self, scheduled) -> bool:
        return (0 < len(scheduled) <= self.max_rows
                and all(s.num_tokens == 1 for s in scheduled))

    def run(self, scheduled) -> torch.Tensor:
        """Logits [len(scheduled), V] of a decode-only step (``fits``), row i for
        ``scheduled[i]``. The result is a view of the graph's output buffer: read it
        before the next step."""
        b = len(scheduled)
        size = next(s for s in self.sizes if s >= b)
        a, o, bs, mb = self._np, self._off, self.block_size, self.max_blocks
        tiles = a[o["tiles"]:o["tiles"] + 4 * self.max_rows].reshape(self.max_rows, 4)
        for i, s in enumerate(scheduled):
            seq = s.seq
            p = seq.num_computed
            table = seq.block_table
            a[o["tokens"] + i] = seq.token_ids[p]
            a[o["positions"] + i] = p
            a[o["slots"] + i] = table[p // bs] * bs + p % bs
            tiles[i] = (i, i, 1, p)
            used = -(-(p + 1) // bs)
            a[o["tables"] + i * mb:o["tables"] + i * mb + used] = table[:used]
        self._pad(b, size)
        # the step's one host-to-device copy: ids, positions, slots and tiles of every row,
        # the block tables of the bucket's rows (at the end of the buffer, row-major)
        n = o["tables"] + size * mb
        self.static[:n].copy_(self.host[:n], non_blocking=True)
        graph, out = self.graphs.get(size, (None, None))
        if graph is None:
            out = self._forward(size)
        else:
            graph.replay()
        return out[:b]
