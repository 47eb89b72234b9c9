"""Applying xgrammar's packed token bitmask to logits, in place.

Semantics (for every backend):

    logits: [B, V] float, bitmask: [B, ceil(V / 32)] int32 (on CPU or the logits' device)
    for b, t: if not (bitmask[b, t // 32] >> (t % 32)) & 1: logits[b, t] = -inf

On CUDA this is xgrammar's own kernel. On CPU xgrammar's kernel costs about 130 us a row
at this vocabulary (49152), so we compile the same expression with torch.compile
(inductor fuses unpack + select into one pass over the row, dynamic in B), and fall back
to the plain-torch reference if compilation is unavailable.
"""

from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger(__name__)

def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Plain torch; the definition the fast paths are tested against."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def _masked(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab] != 0
    logits.masked_fill_(~allowed, float("-inf"))


_compiled = None
_compile_failed = False
_lock = threading.Lock()


def _cpu_kernel():
    global _compiled, _compile_failed
    if _compiled is None and not _compile_failed:
        with _lock:
            if _compiled is None and not _compile_failed:
                try:
                    fn = torch.compile(_masked, dynamic=True, fullgraph=True)
                    probe = torch.zeros(3, 70)
                    fn(probe, torch.full((3, 3), -1, dtype=torch.int32))
                    _compiled = fn
                except Exception as exc:  # no compiler toolchain, unsupported platform
                    _compile_failed = True
                    logger.warning("torch.compile of the bitmask kernel failed (%s); "
                                   "using the slower plain-torch path", exc)
    return _compiled


def warmup() -> bool:
    """Compiles the CPU kernel now (a few seconds, once per process) rather than on the
    first guided step. Returns whether the compiled kernel is in use."""
    return _cpu_kernel() is not None


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Masks ``logits`` in place (see module doc); rows of all ones are left untouched."""
    if logits.numel() == 0:
        return
    if logits.is_cuda:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
        return
    kernel = _cpu_kernel()
    if kernel is None:
        reference_apply(logits, bitmask)
    else:
        kernel(logits, bitmask)
