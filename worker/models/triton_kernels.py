"""The decode step's device kernels, in Triton: a decoder layer runs in nine launches.

    norm (+ residual add) -> QKV GEMM -> RoPE + KV-cache write -> paged attention ->
    O GEMM -> norm (+ residual add) -> gate/up GEMM -> SiLU * up -> down GEMM

The GEMMs are torch's (cuBLAS); the five others live here. Each wrapper states its
semantics in plain torch in its docstring and is tested against that reference
(tests/engine/test_triton_kernels_unit.py) with CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``), and on CUDA where there is a device. On the
``meta`` device a wrapper only makes its outputs: a whole step can then run on any
machine to count its kernels (``count_kernels``) or to catch a tensor on the wrong
device (tests/engine/test_device_step_unit.py).

Attention reads the KV cache in place through the block tables: one kernel serves decode
rows and prefill chunks alike (a tile of one sequence's query tokens against that
sequence's cached keys, causal by position), so the keys of a step's new tokens are
written to the cache first (``rope_and_cache``) and never copied again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# imported on first use (``available``): a CPU worker never pays for it
triton = tl = None

# kernel launches made by the wrappers, counted (count_kernels) when not None
_launches: list[str] | None = None


def available() -> bool:
    """Whether Triton is importable (CUDA torch ships it); imports it on the first call."""
    global triton, tl
    if triton is None:
        try:
            import triton as triton_module
            import triton.language as language
        except ImportError:
            return False
        triton, tl = triton_module, language
    return True


def _shapes_only(name: str, like: torch.Tensor) -> bool:
    """Records a launch (when counting); True when the tensors are on ``meta``, where the
    wrapper only makes its outputs."""
    if _launches is not None:
        _launches.append(name)
    return like.device.type == "meta"


# with TRITON_INTERPRET=1 (set before Triton is imported: tests/conftest.py does so where
# there is no CUDA device) the kernels run on CPU tensors through Triton's interpreter
_jitted: dict = {}


def _jit(fn):
    """The kernel ``fn`` compiled by Triton (made once, after ``available()``)."""
    kernel = _jitted.get(fn)
    if kernel is None:
        available()
        kernel = _jitted[fn] = triton.jit(fn)
    return kernel


# --- RMSNorm with the residual add fused in ---------------------------------------------

def _rms_norm_kernel(X, R, W, OUT, RES_OUT, stride_x, stride_r, stride_o, stride_ro, N, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    xf = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        xf += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        total = xf.to(RES_OUT.dtype.element_ty)  # the sum rounded as torch's add would
        tl.store(RES_OUT + row * stride_ro + cols, total, mask=mask)
        xf = total.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (xf * rstd * w).to(OUT.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """x: [M, N] (unit column stride); weight: [N]. Without ``residual``:
    ``F.rms_norm(x, (N,), weight, eps)``; with it (same shape): ``(rms_norm(x + residual),
    x + residual)``, the sum rounded to x's dtype before the norm, as torch does."""
    m, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if _shapes_only("rms_norm", x):
        return out if residual is None else (out, res_out)
    r = residual if residual is not None else x
    ro = res_out if res_out is not None else out
    block = triton.next_power_of_2(n)
    _jit(_rms_norm_kernel)[(m,)](
        x, r, weight, out, ro, x.stride(0), r.stride(0), out.stride(0), ro.stride(0), n, eps,
        HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out if residual is None else (out, res_out)


# --- SiLU(gate) * up ----------------------------------------------------------------------

def _silu_mul_kernel(GU, OUT, stride_gu, stride_o, I, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + I + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (g / (1.0 + tl.exp(-g)) * u).to(OUT.dtype.element_ty),
             mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[M, 2I] -> ``F.silu(gate_up[:, :I]) * gate_up[:, I:]`` [M, I] (computed in fp32)."""
    m, two_i = gate_up.shape
    i = two_i // 2
    out = gate_up.new_empty(m, i)
    if _shapes_only("silu_mul", gate_up):
        return out
    block = 1024
    _jit(_silu_mul_kernel)[(m, triton.cdiv(i, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), i, BLOCK=block)
    return out


# --- RoPE for q and k, and the KV-cache write ----------------------------------------------

def _rope_cache_kernel(QKV, POS, COS, SIN, SLOTS, KC, VC, QN, KN, stride_t, stride_table,
                       stride_slot, HQ, HKV, D, eps, HALF: tl.constexpr,
                       QK_NORM: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(POS + t)
    d = tl.arange(0, HALF)
    c = tl.load(COS + pos * stride_table + d).to(tl.float32)
    s = tl.load(SIN + pos * stride_table + d).to(tl.float32)
    base = QKV + t * stride_t + h * D
    x1 = tl.load(base + d).to(tl.float32)
    x2 = tl.load(base + HALF + d).to(tl.float32)
    if QK_NORM:  # Qwen3: each head RMS-normed (its own weight for q, for k) before RoPE
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        w = QN if h < HQ else KN
        x1 = x1 * rstd * tl.load(w + d).to(tl.float32)
        x2 = x2 * rstd * tl.load(w + HALF + d).to(tl.float32)
    o1 = (x1 * c - x2 * s).to(QKV.dtype.element_ty)
    o2 = (x2 * c + x1 * s).to(QKV.dtype.element_ty)
    if h < HQ:  # a query head: rotated in place
        tl.store(base + d, o1)
        tl.store(base + HALF + d, o2)
    else:  # a key head: rotated into the cache, with its value head
        kvh = h - HQ
        slot = tl.load(SLOTS + t).to(tl.int64)
        dst = slot * stride_slot + kvh * D
        tl.store(KC + dst + d, o1)
        tl.store(KC + dst + HALF + d, o2)
        v = QKV + t * stride_t + (HQ + HKV + kvh) * D
        tl.store(VC + dst + d, tl.load(v + d))
        tl.store(VC + dst + HALF + d, tl.load(v + HALF + d))


def rope_and_cache(qkv: torch.Tensor, num_q: int, num_kv: int, head_dim: int,
                   positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, qk_norm: tuple | None = None) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) D], the packed projection (unit column stride); positions,
    slot_mapping: [T] int; cos, sin: [max_pos, D] tables (halves equal, as
    RotaryEmbedding's); k_cache, v_cache: [num_slots, Hkv, D]; D a power of two;
    qk_norm: None, or (q weight [D], k weight [D], eps) for Qwen3's per-head RMSNorm.

    Rotates the query heads in place (HF Llama's half split: ``x * cos[pos] +
    rotate_half(x) * sin[pos]``, after ``rms_norm(x) * weight`` with qk_norm), writes the
    rotated key heads to ``k_cache[slot]`` and the value heads to ``v_cache[slot]``.
    Returns q: [T, Hq, D], a view of ``qkv``."""
    t = qkv.shape[0]
    q = qkv[:, :num_q * head_dim].view(t, num_q, head_dim)
    if _shapes_only("rope_and_cache", qkv) or t == 0:
        return q
    qn, kn, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    _jit(_rope_cache_kernel)[(t, num_q + num_kv)](
        qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, qn, kn, qkv.stride(0),
        cos.stride(0), k_cache.stride(0), num_q, num_kv, head_dim, eps, HALF=head_dim // 2,
        QK_NORM=qk_norm is not None)
    return q


# --- paged attention over the cache (decode rows and prefill chunks) -----------------------

@dataclass
class AttentionTiles:
    """Which query tokens one launch of ``paged_attention`` serves, on the device.

    tiles: [num_tiles, 4] int32, per tile: its sequence's row in ``block_tables``, the
        first query token's row in the step's token batch, the tile's token count (at most
        ``tokens_per_tile``) and the first token's position (it sees keys 0..position);
    block_tables: [num_seqs, max_blocks] int32; max_context: the longest context (host).
    """

    tiles: torch.Tensor
    block_tables: torch.Tensor
    tokens_per_tile: int
    max_context: int


def _attention_kernel(Q, KC, VC, OUT, TILES, TABLES, stride_qt, stride_qh, stride_ot,
                      stride_oh, stride_slot, stride_table, scale, G, BLOCK_SIZE,
                      D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(TILES + tile * 4)
    first = tl.load(TILES + tile * 4 + 1)
    count = tl.load(TILES + tile * 4 + 2)
    pos0 = tl.load(TILES + tile * 4 + 3)
    r = tl.arange(0, BLOCK_M)  # row = (token j, query head g of this kv head)
    j = r // G
    head = kvh * G + r % G
    row_ok = j < count
    d = tl.arange(0, D)
    q_ptr = Q + (first + j)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    row_pos = pos0 + j
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    n_keys = pos0 + count  # the tile's last token sees keys 0..pos0 + count - 1
    for start in range(0, n_keys, BLOCK_N):
        kk = start + tl.arange(0, BLOCK_N)
        k_ok = kk < n_keys
        page = tl.load(TABLES + seq * stride_table + kk // BLOCK_SIZE, mask=k_ok, other=0)
        slot = page.to(tl.int64) * BLOCK_SIZE + kk % BLOCK_SIZE
        kv_off = slot[:, None] * stride_slot + kvh * D + d[None, :]
        k = tl.load(KC + kv_off, mask=k_ok[:, None], other=0.0)
        v = tl.load(VC + kv_off, mask=k_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        see = (kk[None, :] <= row_pos[:, None]) & k_ok[None, :]
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                            input_precision=PRECISION).to(tl.float32)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptr = OUT + (first + j)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    tiles: AttentionTiles, block_size: int, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D] (unit last stride); k_cache, v_cache: [num_slots, Hkv, D] holding every
    key of the step already (``rope_and_cache``). For each tile, each of its query tokens
    (row ``first + j``, position ``p = pos0 + j``) and query head h:

        keys = slots of positions 0..p through block_tables[seq]   (head h // (Hq / Hkv))
        out[first + j, h] = softmax(q . keys * scale) @ values

    Returns out: [T, Hq, D] (rows no tile covers are left as they were)."""
    num_q, dim = q.shape[1], q.shape[2]
    num_kv = k_cache.shape[1]
    group = num_q // num_kv
    if out is None:
        out = torch.empty_like(q)
    if _shapes_only("paged_attention", q):
        return out
    num_tiles = tiles.tiles.shape[0]
    if num_tiles == 0:
        return out
    block_m = max(16, triton.next_power_of_2(tiles.tokens_per_tile * group))
    block_n = 64 if dim <= 128 else 32
    _jit(_attention_kernel)[(num_tiles, num_kv)](
        q, k_cache, v_cache, out, tiles.tiles, tiles.block_tables, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), k_cache.stride(0), tiles.block_tables.stride(0), scale,
        group, block_size, D=dim, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32
        # Triton's interpreter has no bf16 / fp16 matmul: it multiplies in fp32
        UPCAST=q.device.type == "cpu" and q.dtype != torch.float32)
    return out


# --- the grammar bitmask -------------------------------------------------------------------

def _bitmask_kernel(LOGITS, MASK, stride_l, stride_m, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    words = tl.load(MASK + row * stride_m + cols // 32, mask=ok, other=-1)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(LOGITS + row * stride_l + cols, float("-inf"), mask=ok & ~allowed)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits: [B, V] float; bitmask: [B, ceil(V / 32)] int32 on the logits' device: where
    bit t of row b is 0, ``logits[b, t] = -inf`` (bitmask.reference_apply's semantics)."""
    b, v = logits.shape
    if _shapes_only("apply_bitmask", logits) or b == 0:
        return
    block = 4096
    _jit(_bitmask_kernel)[(b, triton.cdiv(v, block))](
        logits, bitmask, logits.stride(0), bitmask.stride(0), v, BLOCK=block)


# --- counting ------------------------------------------------------------------------------

def count_kernels(fn, *args, **kwargs):
    """Runs ``fn`` and returns (its result, {kernel name: launches}): every aten op that
    does work (views and allocations excluded: they launch nothing) and every wrapper
    above. Run on ``meta`` tensors it needs no device and no memory."""
    from torch.utils._python_dispatch import TorchDispatchMode

    global _launches
    counts: dict[str, int] = {}

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not (func.is_view or name in _FREE):
                key = f"aten.{name}"
                counts[key] = counts.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    _launches = []
    try:
        with _Count():
            result = fn(*args, **kwargs)
    finally:
        launched, _launches = _launches, None
    for name in launched:
        counts[name] = counts.get(name, 0) + 1
    return result, counts


# ops that launch no kernel: allocations, metadata, and the wrappers' own bookkeeping
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
         "lift_fresh", "_to_copy_meta", "set_", "resize_", "alias", "_unsafe_view"}
