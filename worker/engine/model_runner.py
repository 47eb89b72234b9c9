"""Runs one scheduled step through the model: builds the flat token batch, owns the KV
cache tensors, and returns the logits of the rows that sample."""

from __future__ import annotations

import torch

from worker.engine.scheduler import ScheduledSeq
from worker.models.llama import LlamaForCausalLM
from worker.models.paged_attention import AttentionBatch


def kv_bytes_per_token(model: LlamaForCausalLM, dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * len(model.layers) * model.num_kv_heads * model.head_dim * elem


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int):
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        shape = (num_blocks * block_size, model.num_kv_heads, model.head_dim)
        # per layer: (K, V), each [num_slots, Hkv, D]
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in model.layers
        ]

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int]]:
        """Returns (logits [R, V] fp32, indices into ``scheduled`` of the R sampling rows).
        A sequence samples when this step computes its last pending token."""
        tokens: list[int] = []
        positions: list[int] = []
        decodes, prefills, sample_rows, sample_idx = [], [], [], []
        for i, s in enumerate(scheduled):
            seq, n = s.seq, s.num_tokens
            start = seq.num_computed
            tokens.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            ctx = start + n
            if s.is_decode:
                decodes.append((seq.block_table, ctx))
            else:
                prefills.append((seq.block_table, ctx, n))
            if s.samples:
                sample_rows.append(len(tokens) - 1)
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
