"""Applying xgrammar's packed token bitmask to logits, in place.

Semantics (for every backend):

    logits: [B, V] float, bitmask: [B, ceil(V / 32)] int32 (on CPU or the logits' device)
    for b, t: if not (bitmask[b, t // 32] >> (t % 32)) & 1: logits[b, t] = -inf

On a GPU this is one Triton kernel (worker/models/triton_kernels.py). On CPU, fp32 logits go through a 30-line C kernel
(kernels/bitmask_cpu.c) that skips all-allowed words and writes disallowed ones without
reading them, which beats both xgrammar's CPU kernel and a torch.compile version on
cache-cold logits (per-row figures in docs/benchmarks.md). It is compiled once per machine
with the system C compiler into the rayguide cache (worker/models/native.py) and loaded
with ctypes (which releases the GIL). Without a compiler, the plain-torch reference below
is used.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from worker.models import native, triton_kernels


_SOURCE = Path(__file__).parent / "kernels" / "bitmask_cpu.c"


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Plain torch; the definition the fast paths are tested against."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def _bind(lib: ctypes.CDLL):
    fn = lib.apply_bitmask_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64]
    fn.restype = None
    return fn


_cpu_kernel = native.LazyKernel(_SOURCE, _bind, "using the slower plain-torch path",
                                needs_avx2=False)


def warmup() -> bool:
    """Builds / loads the CPU kernel now rather than on the first guided step. Returns
    whether the fast kernel is in use."""
    return _cpu_kernel() is not None


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Masks ``logits`` in place (see module doc); rows of all ones are left untouched."""
    if logits.numel() == 0:
        return
    if logits.device.type != "cpu":
        if triton_kernels.available():  # one kernel; only shapes on meta
            triton_kernels.apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True))
        else:
            reference_apply(logits, bitmask)
        return
    kernel = _cpu_kernel() if logits.dtype == torch.float32 else None
    if (kernel is None or logits.stride(-1) != 1 or bitmask.stride(-1) != 1
            or bitmask.dtype != torch.int32 or bitmask.device.type != "cpu"):
        reference_apply(logits, bitmask)
        return
    if bitmask.shape[0] < logits.shape[0] or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover logits "
                         f"{tuple(logits.shape)}")
    kernel(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
           logits.shape[0], logits.shape[1])
