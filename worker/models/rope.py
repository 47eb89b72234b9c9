"""Rotary position embedding with the RoPE scaling that config.json declares.

The inverse frequencies for scaled variants (linear, llama3, yarn, ...) come from
transformers' own table, so they follow the reference implementation exactly; the cos/sin
tables are precomputed once for every position and indexed per step.
"""

from __future__ import annotations

import torch
from torch import nn

# Dynamic variants change frequencies with the current length; a static table cannot do that.
_UNSUPPORTED = ("dynamic", "longrope")


def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        params = rope_parameters(config)
        rope_type = params["rope_type"]
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        if rope_type in _UNSUPPORTED:
            raise ValueError(f"RoPE scaling {rope_type!r} is not supported; use a checkpoint "
                             "with default, linear, llama3 or yarn RoPE")
        if rope_type == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (
                torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unknown RoPE scaling type {rope_type!r} in config.json")
            with torch.device("cpu"):  # also when the model is being built on "meta"
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        self._inv_freq = inv_freq.to("cpu", torch.float64)
        self._scaling = float(scaling)
        self._max_pos = int(config.max_position_embeddings)
        self.register_buffer("cos_table", torch.empty(0), persistent=False)
        self.register_buffer("sin_table", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self, device=None, dtype=None) -> None:
        """(Re)computes the cos/sin tables; the loader calls it after materializing a model
        that was built on the meta device."""
        device = device or self.cos_table.device
        if device.type == "meta":
            return
        freqs = torch.outer(torch.arange(self._max_pos, dtype=torch.float64, device="cpu"),
                            self._inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        dtype = dtype or torch.float32
        self.cos_table = (emb.cos() * self._scaling).to(device, dtype)
        self.sin_table = (emb.sin() * self._scaling).to(device, dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, head_dim] each, in the model's dtype
        return self.cos_table[positions], self.sin_table[positions]

    @staticmethod
    def apply(q, k, cos, sin):
        """q: [T, Hq, D], k: [T, Hkv, D]; the half-split rotation of HF Llama."""
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
