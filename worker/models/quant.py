"""Weight-only int8 for the Linear layers on CPU (``EngineConfig.dtype = "int8"``).

Each Linear weight [N, K] becomes int8 with one fp32 scale per output channel (symmetric,
``scale[n] = max_k |w[n, k]| / 127``); activations, norms, RoPE, attention, the KV cache
and the embedding lookup stay fp32. The logits projection gets its own int8 copy of the
(tied) embedding, since at batch 1 it is a fifth of all the weight bytes a step reads.

Why our own kernel: on this kind of CPU (AVX2, no AVX-512) torch's
``aten._weight_int8pack_mm`` runs a scalar path, 5-10x *slower* than the fp32 matmul it
would replace, and bf16 weights are slower than fp32 too (docs/benchmarks.md, "int8
kernels"). Decode is bound by reading weights, so ``kernels/int8_linear_cpu.c`` reads one
byte per weight and widens it in registers. It is compiled once per machine with the
system C compiler into the rayguide cache (``native``) and called through ctypes (which releases the
GIL). Batches above ``DEQUANT_MIN_ROWS`` rows (prefill chunks) dequantize the weight into
a reused fp32 buffer and use torch's sgemm, which is compute-bound there anyway. Without a
C compiler everything takes the dequantize path: correct, not faster than fp32.

Where the kernel's shapes fit (``N % 4 == 0``, ``K % 16 == 0``: every layer of the supported
models), the int8 weight is kept packed as ``[N/4, K/16, 4, 16]`` (``pack``): the 16 columns
of four output channels in one 64-byte line, so the kernel reads one contiguous stream
(about 2-3x the bandwidth of reading four short rows at once). ``Int8Linear.int8_weight()``
gives the plain ``[N, K]`` view back.

Semantics (the reference the kernel is tested against):

    y = x @ (int8_weight().float() * scale[:, None]).T + bias     # x: [M, K], y: [M, N]
"""

from __future__ import annotations

import ctypes
import threading

import torch
from torch import nn

from worker.models import native


_SOURCE = native.KERNELS / "int8_linear_cpu.c"
# From this many rows on, the fp32 sgemm on a dequantized copy is faster than the int8
# kernel: 32 on AVX2 (docs/benchmarks.md, "int8 kernels"); with AVX512-VNNI (vpdpwssd) the
# kernel stays ahead to about 64 ("Kernels for the small ops and small batches").
DEQUANT_MIN_ROWS = 64 if "avx512_vnni" in native.cpu_model().rpartition("\n")[2].split() else 32


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (int8 [N, K], fp32 scale [N]), symmetric per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # [N, K]
    return q.contiguous(), scale.contiguous()


PACK_ROWS, PACK_COLS = 4, 16  # the kernel's chunk: 4 output channels x 16 columns


def packable(n: int, k: int) -> bool:
    return n % PACK_ROWS == 0 and k % PACK_COLS == 0


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernel's layout [N/4, K/16, 4, 16] (contiguous)."""
    n, k = q.shape
    return q.view(n // PACK_ROWS, PACK_ROWS, k // PACK_COLS, PACK_COLS).transpose(1, 2).contiguous()


def unpack(p: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack``: [N/4, K/16, 4, 16] -> int8 [N, K]."""
    g, c, r, w = p.shape
    return p.transpose(1, 2).reshape(g * r, c * w)


def reference_linear(x, weight_q, scale, bias=None) -> torch.Tensor:
    """Plain torch; the definition the kernel is tested against."""
    return torch.nn.functional.linear(x.float(), weight_q.float() * scale[:, None], bias)


class Int8Linear(nn.Module):
    """A Linear layer whose weight is int8 with per-output-channel fp32 scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        q, scale = quantize_weight(weight)
        self.out_features, self.in_features = q.shape
        self.packed = packable(*q.shape)
        # buffers, not parameters: nothing trains them, and the engine reads the model's
        # compute dtype from its first parameter (the fp32 embedding)
        self.register_buffer("weight_q", pack(q) if self.packed else q)  # int8
        self.register_buffer("scale", scale)  # [N] fp32
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._fast = None  # see forward

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        return cls(linear.weight, linear.bias)

    def int8_weight(self) -> torch.Tensor:
        """The int8 weight as [N, K] (a copy where it is kept packed)."""
        return unpack(self.weight_q) if self.packed else self.weight_q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = self._fast
        if fast is None:
            fast = self._fast = self._kernel_call()
        if (fast and x.dim() == 2 and x.shape[0] < DEQUANT_MIN_ROWS and x.is_cpu
                and x.dtype == torch.float32 and x.stride(1) == 1):
            # the decode path: module attributes are slow (~1 us each), so everything the
            # call needs besides x and y is one tuple made at first use (``_kernel_call``)
            call, w, s, b, n, k = fast
            m = x.shape[0]
            y = x.new_empty(m, n)
            if call(x.data_ptr(), x.stride(0), w, s, b, y.data_ptr(), n, m, n, k,
                    torch.get_num_threads()):
                raise MemoryError(f"int8 linear: no memory for {m} x {k} rows")
            return y
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        m = x2.shape[0]
        if m < DEQUANT_MIN_ROWS and fast and x2.is_cpu and x2.dtype == torch.float32:
            return self.forward(x2.contiguous()).view(*lead, self.out_features)
        kernel = _kernel() if self._kernel_fits(x2) else None
        y = torch.nn.functional.linear(x2, self._dequantized(kernel), self.bias)
        return y.view(*lead, self.out_features)

    def _kernel_call(self):
        """(kernel, weight, scale and bias addresses, N, K), or False where the kernel
        cannot run this layer (no kernel, unpacked shape, weights off the CPU)."""
        kernel = _kernel() if self.packed and self.weight_q.is_cpu else None
        if kernel is None:
            return False
        bias = None if self.bias is None else self.bias.data_ptr()
        return (kernel.linear, self.weight_q.data_ptr(), self.scale.data_ptr(), bias,
                self.out_features, self.in_features)

    def _apply(self, fn, recurse=True):
        self._fast = None  # .to() and friends may move the buffers: addresses made again
        return super()._apply(fn, recurse)

    def _kernel_fits(self, x2: torch.Tensor) -> bool:
        return x2.device.type == "cpu" and x2.dtype == torch.float32 and self.packed

    def _dequantized(self, kernel) -> torch.Tensor:
        """The fp32 weight [N, K] in a per-thread buffer shared by all layers of its size
        (a fresh multi-MB tensor per call costs page faults)."""
        n, k = self.out_features, self.in_features
        out = _scratch(n * k).view(n, k)
        if kernel is None or self.weight_q.device.type != "cpu":
            torch.mul(self.int8_weight().float(), self.scale[:, None], out=out)
        else:
            kernel.dequant(self.weight_q.data_ptr(), self.scale.data_ptr(), out.data_ptr(),
                           n, k, torch.get_num_threads())
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 per-channel")


_scratch_local = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    bufs = getattr(_scratch_local, "bufs", None)
    if bufs is None:
        bufs = _scratch_local.bufs = {}
    if numel not in bufs:
        bufs[numel] = torch.empty(numel)
    return bufs[numel]


def quantize_model_(model) -> None:
    """Replaces every nn.Linear of a LlamaForCausalLM with Int8Linear, in place, and gives
    it an int8 logits projection (a quantized copy when the embedding is tied)."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = Int8Linear.from_linear(attn.qkv_proj)
        attn.o_proj = Int8Linear.from_linear(attn.o_proj)
        mlp.gate_up_proj = Int8Linear.from_linear(mlp.gate_up_proj)
        mlp.down_proj = Int8Linear.from_linear(mlp.down_proj)
    head = model.embed_tokens.weight if model.tie_word_embeddings else model.lm_head.weight
    model.lm_head = Int8Linear(head)
    model.quantization = "int8"


# --- the C kernel ------------------------------------------------------------------------

class _Kernel:
    def __init__(self, lib: ctypes.CDLL):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.linear = lib.int8_linear_f32
        self.linear.argtypes = [p, i64, p, p, p, p, i64, i64, i64, i64, i64]
        self.linear.restype = ctypes.c_int  # 1: out of memory for the int16 rows
        self.dequant = lib.int8_dequant_f32
        self.dequant.argtypes = [p, p, p, i64, i64, i64]
        self.dequant.restype = None


# the compiled kernel, built on first use; None where it cannot be built (no C compiler,
# not x86-64 with AVX2)
_kernel = native.LazyKernel(_SOURCE, _Kernel, "int8 weights are dequantized per call "
                            "(correct, not faster)")


def kernel_available() -> bool:
    """Builds / loads the kernel now; whether the fast path is in use."""
    return _kernel() is not None


# --- quality ---------------------------------------------------------------------------------

@torch.no_grad()
def greedy_tokens(model, ids: list[int], chunk: int = 16, block_size: int = 16) -> torch.Tensor:
    """Teacher-forced next-token argmax at every position of ``ids`` ([len(ids)] int64),
    fed through the paged-attention path in chunks of ``chunk`` tokens (small chunks keep
    an int8 model on its decode kernel rather than the dequantized prefill path)."""
    from worker.models.paged_attention import AttentionBatch

    n = len(ids)
    num_blocks = -(-n // block_size)
    shape = (num_blocks * block_size, model.num_kv_heads, model.head_dim)  # [slots, Hkv, D]
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.layers]
    table = list(range(num_blocks))
    out = []
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        batch = AttentionBatch.build([], [(table, hi, hi - lo)], block_size)
        hidden = model(torch.tensor(ids[lo:hi]), torch.arange(lo, hi), caches, batch)
        out.append(model.compute_logits(hidden).argmax(-1))
    return torch.cat(out)


def top1_agreement(reference, model, ids: list[int], chunk: int = 16) -> float:
    """Share of positions where ``model``'s greedy next token equals ``reference``'s."""
    a, b = greedy_tokens(reference, ids, chunk), greedy_tokens(model, ids, chunk)
    return (a == b).float().mean().item()
