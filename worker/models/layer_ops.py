"""RMSNorm (with the residual add fused in), RoPE, SiLU-and-mul and small-batch Linear
layers through one small C library (kernels/layer_ops_cpu.c) for fp32 tensors on the CPU.

Each function returns None where it does not apply (CUDA, bf16, a layout it does not
take, no C compiler or no AVX2: see ``native``), and the caller runs its torch code, which
is the definition these are tested against (tests/engine/test_layer_ops.py).
"""

from __future__ import annotations

import ctypes

import torch

from torch import nn
import torch.nn.functional as F

from worker.models import native


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.rms_norm_f32.argtypes = [p, i64, p, p, p, p, i64, i64, i64, f32, i64]
    lib.rms_norm_f32.restype = None
    lib.rope_f32.argtypes = [p, i64, p, p, i64, i64, i64, i64]
    lib.rope_f32.restype = None
    lib.silu_mul_f32.argtypes = [p, i64, p, i64, i64, i64]
    lib.silu_mul_f32.restype = None
    lib.f32_linear.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, i64]
    lib.f32_linear.restype = None
    return lib


_library = native.LazyKernel(native.KERNELS / "layer_ops_cpu.c", _bind,
                             "norms, RoPE and SiLU run as torch ops (slower at small batches)")


def available() -> bool:
    """Builds / loads the library now; whether the fp32 CPU paths use it."""
    return _library() is not None


def _fits(x: torch.Tensor) -> bool:
    return x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """``F.rms_norm(x, ..)`` ([M, K] -> [M, K]), or with ``residual``: (norm(x + residual),
    x + residual). None where the C path does not apply."""
    lib = _library()
    if lib is None or not _fits(x) or weight.dtype != torch.float32:
        return None
    m, k = x.shape
    out = torch.empty(m, k)
    if residual is None:
        lib.rms_norm_f32(x.data_ptr(), x.stride(0), None, None, weight.data_ptr(),
                         out.data_ptr(), k, m, k, eps, torch.get_num_threads())
        return out
    if not (residual.is_contiguous() and residual.dtype == torch.float32
            and residual.shape == x.shape):
        return None
    total = torch.empty(m, k)
    lib.rms_norm_f32(x.data_ptr(), x.stride(0), residual.data_ptr(), total.data_ptr(),
                     weight.data_ptr(), out.data_ptr(), k, m, k, eps, torch.get_num_threads())
    return out, total


def _rope_fits(x: torch.Tensor, cos: torch.Tensor) -> bool:
    return (x.is_cpu and x.dtype == torch.float32 and x.dim() == 3 and x.stride(2) == 1
            and x.stride(1) == x.shape[2] and cos.shape == (x.shape[0], x.shape[2]))


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (heads contiguous, any row stride:
    views of the packed qkv output); cos, sin: [T, D] fp32. Both or neither: False where
    the C path does not apply to either, and nothing was changed."""
    lib = _library()
    if (lib is None or cos.dtype != torch.float32 or not cos.is_contiguous()
            or not sin.is_contiguous() or not _rope_fits(q, cos) or not _rope_fits(k, cos)):
        return False
    threads = torch.get_num_threads()
    for x in (q, k):
        t, h, d = x.shape
        lib.rope_f32(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), t, h, d, threads)
    return True


def silu_mul(gate_up: torch.Tensor):
    """[M, 2I] -> silu(gate) * up [M, I]; None where the C path does not apply."""
    lib = _library()
    if lib is None or not _fits(gate_up):
        return None
    m, two_i = gate_up.shape
    out = torch.empty(m, two_i // 2)
    lib.silu_mul_f32(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), m, two_i // 2,
                     torch.get_num_threads())
    return out


# At this many rows and more, torch's blocked sgemm (compute-bound there) takes over.
LINEAR_MAX_ROWS = 32


def linear_call(weight: torch.Tensor, bias: torch.Tensor | None):
    """(C function, weight address, bias address, N, K) for ``linear``, or False where the
    weight does not fit the kernel (not fp32 on the CPU, not contiguous, N % 4 or K % 8)."""
    lib = _library()
    n, k = weight.shape
    if (lib is None or not weight.is_cpu or weight.dtype != torch.float32
            or not weight.is_contiguous() or n % 4 or k % 8
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))):
        return False
    return lib.f32_linear, weight.data_ptr(), None if bias is None else bias.data_ptr(), n, k


def linear(x: torch.Tensor, call) -> torch.Tensor | None:
    """``x @ weight.T + bias`` through ``call`` (``linear_call``'s tuple) for [M, K] fp32 x
    with M < LINEAR_MAX_ROWS and inference mode (no autograd graph); else None."""
    if (not call or x.dim() != 2 or x.shape[0] >= LINEAR_MAX_ROWS or not x.is_cpu
            or x.dtype != torch.float32 or x.stride(1) != 1 or torch.is_grad_enabled()):
        return None
    fn, w, b, n, k = call
    m = x.shape[0]
    y = x.new_empty(m, n)
    fn(x.data_ptr(), x.stride(0), w, b, y.data_ptr(), n, m, n, k, torch.get_num_threads())
    return y


class Linear(nn.Linear):
    """``nn.Linear`` whose forward takes the C kernel at decode-sized batches (fp32, CPU,
    no autograd); parameters, names and loading are nn.Linear's."""

    _call = None  # (weight, bias, linear_call tuple), made at first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cached = self._call
        params = self._parameters
        if cached is None or cached[0] is not params["weight"] or cached[1] is not params["bias"]:
            cached = self._call = (params["weight"], params["bias"],
                                   linear_call(params["weight"], params["bias"]))
        y = linear(x, cached[2])
        return F.linear(x, self.weight, self.bias) if y is None else y

    def _apply(self, fn, recurse=True):
        self._call = None  # .to() and friends may move the parameters
        return super()._apply(fn, recurse)
