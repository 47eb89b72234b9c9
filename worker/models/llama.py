"""Lean decoder-only model for the Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3.

The families differ only in data this module reads from the HF config: attention/qkv bias
(Qwen2), per-head q/k RMSNorm (Qwen3), tied embeddings (SmolLM2, small Qwen), head_dim and
RoPE scaling. q/k/v and gate/up projections are packed into one matmul each; the
checkpoint's separate tensors are copied into their shard (``PACKED_MODULES``).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
import torch.nn.functional as F

from worker.models import layer_ops, triton_kernels
from worker.models.paged_attention import AttentionBatch, paged_attention
from worker.models.rope import RotaryEmbedding

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# checkpoint projection name -> (packed parameter name, shard index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with ``residual``: (norm(x + residual), x + residual), the residual
        add fused into the norm (one C call on the CPU: ``layer_ops``)."""
        if x.device.type != "cpu" and x.dim() == 2 and triton_kernels.available():
            return triton_kernels.rms_norm(x, self.weight, self.eps, residual)
        out = layer_ops.rms_norm(x, self.weight, self.eps, residual)
        if out is not None:
            return out
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        total = x + residual
        return F.rms_norm(total, self.weight.shape, self.weight, self.eps), total


class Attention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        self.qkv_proj = layer_ops.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                         bias=qkv_bias)
        self.o_proj = layer_ops.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, sin, kv_cache, batch: AttentionBatch) -> torch.Tensor:
        # x: [T, hidden]; cos/sin: [T, head_dim]
        qkv = self.qkv_proj(x)
        if batch.tiles:  # the device kernels: RoPE writes K/V to the cache, attention reads it
            k_cache, v_cache = kv_cache
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) \
                if self.qk_norm else None
            q = triton_kernels.rope_and_cache(
                qkv, self.num_heads, self.num_kv_heads, self.head_dim, batch.positions,
                self.rotary.cos_table, self.rotary.sin_table, batch.slot_mapping, k_cache,
                v_cache, norms)
            o = None
            for tiles in batch.tiles:
                o = triton_kernels.paged_attention(q, k_cache, v_cache, tiles,
                                                   batch.block_size, self.scale, out=o)
            return self.o_proj(o.reshape(-1, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if not layer_ops.rope_(q, k, cos, sin):  # in place where it can
            q, k = self.rotary.apply(q, k, cos, sin)
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], batch, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate = config.intermediate_size
        self.gate_up_proj = layer_ops.Linear(config.hidden_size, 2 * self.intermediate,
                                             bias=bias)
        self.down_proj = layer_ops.Linear(self.intermediate, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if x.device.type != "cpu" and triton_kernels.available():
            return self.down_proj(triton_kernels.silu_mul(gate_up))
        h = layer_ops.silu_mul(gate_up)
        if h is None:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            h = F.silu(gate) * up
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, cos, sin, kv_cache, batch):
        """Returns (this layer's MLP output, the residual stream before it): the next
        norm adds them (x_out = residual + mlp), so each add is fused into a norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        a = self.self_attn(h, cos, sin, kv_cache, batch)
        h, residual = self.post_attention_layernorm(a, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """``forward`` runs a flat token batch and returns hidden states; ``compute_logits``
    projects only the rows that are sampled (the last token of each finished chunk)."""

    def __init__(self, config):
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r} is not supported; rayguide runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
            )
        self.config = config
        self.rotary = RotaryEmbedding(config)
        # weights come from the checkpoint: no random init (on the meta device, Embedding's
        # normal_ goes through torch's reference ops, which import torch._dynamo: seconds)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size,
                                                             config.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.rotary) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = layer_ops.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._head_call = None  # the tied logits projection's kernel call, made at first use

    def _apply(self, fn, recurse=True):
        self._head_call = None  # .to() and friends may move the embedding
        return super()._apply(fn, recurse)

    @property
    def supports_tiled_attention(self) -> bool:
        """Whether the device kernels' attention path serves this model (its kernels take
        a head size that is a power of two: 64 and 128 in every supported family)."""
        d = self.head_dim
        return d >= 16 and d & (d - 1) == 0

    @property
    def head_dim(self) -> int:
        return self.layers[0].self_attn.head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        batch: AttentionBatch,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # the tiled path reads the tables inside its RoPE kernel
        cos, sin = (None, None) if batch.tiles else self.rotary.cos_sin(positions)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv, batch)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tie_word_embeddings and not hasattr(self, "lm_head"):
            weight = self.embed_tokens.weight
            if self._head_call is None or self._head_call[0] is not weight:
                self._head_call = (weight, layer_ops.linear_call(weight, None))
            out = layer_ops.linear(hidden, self._head_call[1])
            return (F.linear(hidden, weight) if out is None else out).float()
        return self.lm_head(hidden).float()  # untied, or quantized (worker/models/quant.py)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (HF names) into the parameters, packing q/k/v and
        gate/up. Every parameter must be covered, else a clear error names the missing ones."""
        params = dict(self.named_parameters())
        loaded: dict[str, set[int] | None] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("lm_head.") and self.tie_word_embeddings:
                continue
            if "rotary_emb" in name:
                continue
            for proj, (packed, shard) in PACKED_MODULES.items():
                if f".{proj}." in name:
                    target = name.replace(f".{proj}.", f".{packed}.")
                    self._copy_shard(params, target, shard, tensor)
                    loaded.setdefault(target, set()).add(shard)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                params[name].copy_(tensor)
                loaded[name] = None
        missing = [n for n in params if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def _copy_shard(self, params, target: str, shard: int, tensor: torch.Tensor) -> None:
        param = params[target]
        if ".qkv_proj." in target:
            attn = self.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.layers[0].mlp.intermediate] * 2
        offset = sum(sizes[:shard])
        param[offset:offset + sizes[shard]].copy_(tensor)
