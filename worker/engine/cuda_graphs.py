"""CUDA graphs for the decode step of the tiled (GPU) path.

A decode step of a batch-1 8B model launches a few hundred kernels whose launch cost, on
the host, exceeds the time the GPU needs to run them. A CUDA graph records one step's
launches once and replays them with one call. A graph replays on the very tensors it
recorded, so everything a step varies lives in static device buffers that each step
overwrites (one host-to-device copy, as the eager path): the token ids, positions, KV-cache
slots, attention tiles and block tables of up to ``size`` rows, ``size`` tokens, one of a few
buckets (1, 2, 4, 8, 16, 24, 32, 48, 64, then every 32 up to twice ``max_num_seqs``). A
step of ``t`` tokens replays the smallest bucket that holds them; the tokens beyond ``t``
are padding that changes nothing: their attention tile has no query (the kernel skips it),
and their key and value land in a scratch slot no sequence owns (``scratch_slot``, one
block past the block manager's).

A row may bring more than one token: its sampled token and the text jump-forward forced
after it (a guided row, most steps at batch 32 and more). Each token is its own one-token
attention tile at its own position, so such a step is still a graph replay; without this,
one forced token anywhere in the batch made the whole step eager (measured on an H200: a
guided batch-32 step 52 ms eager against 6.5 ms unguided with graphs). A prompt's prefill
(more than ``MAX_ROW_TOKENS`` tokens) runs eagerly.

The block table width is fixed at the longest context (``max_model_len`` in blocks);
entries past a row's context are never read, so a step writes only each row's own blocks.

The host side of that copy is two pinned buffers used in turn (``HostStaging``), each
fenced: the copy is asynchronous and reads its buffer when the device reaches it, so a
buffer is written again only once the copy that read it is done. With one buffer, the
overlapped step (engine.py) where no row samples returns before anything synchronises,
and the next step rewrote the buffer under a copy still queued.

A replay that raises turns the graphs off for this worker: that step runs eagerly on the
same static buffers, and every later step takes the runner's eager path.

Without CUDA (tests), ``capture=False`` keeps everything but the recording: the same static
buffers, padding and bucket choice, the forward run eagerly on them
(tests/engine/test_cuda_graphs.py holds its greedy output equal to the eager runner's;
tests/engine/test_graph_staging_unit.py runs the copies late on a fake stream).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from worker.models.paged_attention import AttentionBatch
from worker.models.triton_kernels import AttentionTiles

logger = logging.getLogger(__name__)

FIRST_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def bucket_sizes(max_rows: int) -> list[int]:
    """The batch sizes a graph is recorded at, the last one ``max_rows``."""
    sizes = [b for b in FIRST_BUCKETS if b < max_rows]
    nxt = 96
    while nxt < max_rows:
        sizes.append(nxt)
        nxt += 32
    return sizes + [max_rows]


# the most tokens one row may bring to a graph step (a decode token and what jump-forward
# forced after it); a row with more (a prompt's prefill) makes the step eager
MAX_ROW_TOKENS = 16


class CopyStream:
    """How a host buffer reaches the device: on CUDA from pinned memory, a non-blocking copy
    on the current stream and an event after it; elsewhere a plain copy, done when it
    returns (no fence). Tests pass a stream that runs copies late."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def host_buffer(self, n: int) -> torch.Tensor:
        t = torch.zeros(n, dtype=torch.int32)
        return t.pin_memory() if self.cuda else t

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self.cuda)

    def fence(self):
        """An event that completes when everything queued so far has (None: nothing is
        ever pending)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event


class HostStaging:
    """Two host buffers used in turn for a step's one host-to-device copy. ``take`` hands
    out the next one once the copy that last read it is done (its fence); ``upload``
    queues its copy and fences it. The wait is on the copy of two steps before, which the
    device reached long ago."""

    def __init__(self, total: int, stream: CopyStream):
        self.stream = stream
        self.buffers = [stream.host_buffer(total) for _ in range(2)]
        self.arrays = [b.numpy() for b in self.buffers]  # the same memory, for the host
        self._fences: list = [None, None]
        self._turn = 0

    def take(self) -> np.ndarray:
        """The buffer to fill (as an array over its memory): nothing reads it any more."""
        fence = self._fences[self._turn]
        if fence is not None:
            fence.synchronize()
            self._fences[self._turn] = None
        return self.arrays[self._turn]

    def upload(self, dst: torch.Tensor, n: int) -> None:
        """Queues the copy of the first ``n`` values of the buffer ``take`` gave into
        ``dst``, and fences it; the next ``take`` hands out the other buffer."""
        k = self._turn
        self.stream.copy(dst[:n], self.buffers[k][:n])
        self._fences[k] = self.stream.fence()
        self._turn = 1 - k


class DecodeGraphs:
    def __init__(self, model, kv_caches, block_size: int, max_rows: int, max_blocks: int,
                 scratch_slot: int, capture: bool, stream: CopyStream | None = None):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        # a step of up to max_rows rows whose tokens (one each, a few more where
        # jump-forward forced text) number up to twice that
        self.max_rows, self.max_tokens = max_rows, 2 * max_rows
        self.sizes = bucket_sizes(self.max_tokens)
        self.max_blocks, self.scratch_slot = max_blocks, scratch_slot
        self.capture = capture
        device = next(model.parameters()).device
        t, r = self.max_tokens, max_rows
        # layout: tokens [t] | positions [t] | slots [t] | tiles [t, 4] | sampled [t] (a
        # row's last token's, or each of a draft's) | tables [r, mb]
        self._off = {"tokens": 0, "positions": t, "slots": 2 * t, "tiles": 3 * t,
                     "sampled": 7 * t, "tables": 8 * t}
        total = 8 * t + r * max_blocks
        self.staging = HostStaging(total, stream or CopyStream(device))
        self.static = torch.zeros(total, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.pool = None
        self.memory_bytes = 0  # what the recorded graphs hold (CUDA only)
        self.usable = True  # False once a replay failed: no step fits any more

    def disable(self, why: str) -> None:
        """Turns the graphs off for good (their memory goes back): steps run eagerly."""
        logger.warning("CUDA graphs off for this worker: %s; steps run eagerly", why)
        self.usable = False
        self.graphs.clear()
        self.pool = None

    # --- the static buffers -------------------------------------------------------------

    def _tiles(self, a: np.ndarray) -> np.ndarray:
        o = self._off
        return a[o["tiles"]:o["tiles"] + 4 * self.max_tokens].reshape(self.max_tokens, 4)

    def _inputs(self, size: int):
        s, o, t = self.static, self._off, self.max_tokens
        ids = s[o["tokens"]:o["tokens"] + size]
        pos = s[o["positions"]:o["positions"] + size]
        slots = s[o["slots"]:o["slots"] + size]
        tiles = s[o["tiles"]:o["tiles"] + 4 * t].view(t, 4)[:size]
        tables = s[o["tables"]:].view(self.max_rows, self.max_blocks)
        batch = AttentionBatch(slot_mapping=slots, block_size=self.block_size, positions=pos,
                               tiles=[AttentionTiles(tiles, tables, 1, 0)])
        return ids, pos, batch

    def _forward(self, size: int) -> torch.Tensor:
        ids, pos, batch = self._inputs(size)
        hidden = self.model(ids, pos, self.kv_caches, batch)
        return self.model.compute_logits(hidden)

    def _pad(self, a: np.ndarray, first: int, size: int) -> None:
        """Tokens first..size-1 of the host buffer ``a`` as padding (no query, the scratch
        slot)."""
        o = self._off
        if first >= size:
            return
        a[o["tokens"] + first:o["tokens"] + size] = 0
        a[o["positions"] + first:o["positions"] + size] = 0
        a[o["slots"] + first:o["slots"] + size] = self.scratch_slot
        tiles = self._tiles(a)
        tiles[first:size] = 0
        tiles[first:size, 1] = np.arange(first, size)

    # --- recording ----------------------------------------------------------------------

    @torch.inference_mode()
    def record(self) -> None:
        """Records one graph per bucket, largest first (they share one memory pool, so the
        smaller ones reuse its blocks). Without ``capture``, nothing to record."""
        if not self.capture:
            return
        self._pad(self.staging.take(), 0, self.max_tokens)
        self.staging.upload(self.static, len(self.static))
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        reserved_before = torch.cuda.memory_reserved()
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
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info()[0],
                                torch.cuda.memory_reserved() - reserved_before)

    # --- a step -------------------------------------------------------------------------

    def fits(self, scheduled) -> bool:
        """A step of decode rows, each with at most MAX_ROW_TOKENS tokens (its sampled
        token and jump-forward's forced ones), within the largest bucket."""
        if not self.usable or not 0 < len(scheduled) <= self.max_rows:
            return False
        total = 0
        for s in scheduled:
            if s.num_tokens > MAX_ROW_TOKENS:
                return False
            total += s.num_tokens
        return total <= self.max_tokens

    def run(self, scheduled) -> tuple[torch.Tensor, list[int]]:
        """(logits of the sampling rows [R, V], their indices into ``scheduled``) of a step
        that ``fits``. Each token is a one-token attention tile at its own position: a
        row's later tokens see the keys its earlier ones wrote in the same layer. The
        logits are a view of the graph's output buffer (or of an index into it): read
        them before the next step."""
        a, o, bs, mb = self.staging.take(), self._off, self.block_size, self.max_blocks
        tiles = self._tiles(a)
        sampled: list[int] = []
        t = r = 0
        for i, s in enumerate(scheduled):
            seq, n = s.seq, s.num_tokens
            start = seq.num_computed
            table = seq.block_table
            for p in range(start, start + n):
                a[o["tokens"] + t] = seq.token_ids[p]
                a[o["positions"] + t] = p
                a[o["slots"] + t] = table[p // bs] * bs + p % bs
                tiles[t] = (i, t, 1, p)
                t += 1
            used = -(-(start + n) // bs)
            a[o["tables"] + i * mb:o["tables"] + i * mb + used] = table[:used]
            if s.samples:  # the logits after its last token (after each, for a draft)
                for q in range(t - s.num_logits, t):
                    a[o["sampled"] + r] = q
                    r += 1
                sampled.append(i)
        size = next(b for b in self.sizes if b >= t)
        self._pad(a, t, size)
        # the step's one host-to-device copy: everything up to the bucket's block tables
        # (which end the buffer, row-major)
        self.staging.upload(self.static, o["tables"] + len(scheduled) * mb)
        graph, out = self.graphs.get(size, (None, None))
        if graph is not None:
            try:
                graph.replay()
            except Exception as e:  # this step runs eagerly on the same inputs, and the
                # next ones take the runner's eager path: not one failed batch each
                self.disable(f"a replay failed ({type(e).__name__}: {e})")
                graph = None
        if graph is None:
            out = self._forward(size)
        if t == r:  # every token's logits, in order
            return out[:t], sampled
        rows = self.static[o["sampled"]:o["sampled"] + r].long()
        return out.index_select(0, rows), sampled
