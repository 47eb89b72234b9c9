"""The CPU decode-attention kernel against the torch path (gathered blocks + SDPA), on
random caches, block tables in any order, grouped-query heads and contexts of 1 to 300."""

import random

import pytest
import torch

from worker.models import native, paged_attention as pa

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("kernel_threads")]

needs_kernel = pytest.mark.skipif(not native.has_avx2_fma() or not pa.decode_kernel_available(),
                                  reason="the kernel needs x86-64 with AVX2, FMA and a C compiler")


def _case(seed, lens, hq=9, hkv=3, dim=64, bs=16, num_blocks=64):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    k_cache = torch.randn(num_blocks * bs, hkv, dim)
    v_cache = torch.randn(num_blocks * bs, hkv, dim)
    free = list(range(num_blocks))
    rng.shuffle(free)
    decodes = []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // bs))]
        decodes.append((table, n))
    batch = pa.AttentionBatch.build(decodes, [], bs)
    q = torch.randn(len(lens), hq, dim)
    k = torch.randn(len(lens), hkv, dim)
    v = torch.randn(len(lens), hkv, dim)
    return q, k, v, k_cache, v_cache, batch


def _run(case, kernel: bool, monkeypatch):
    q, k, v, k_cache, v_cache, batch = case
    with monkeypatch.context() as m:
        if not kernel:
            m.setattr(pa, "_decode_in_place", lambda *a: False)
        return pa.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), batch, 0.125)


@needs_kernel
@pytest.mark.parametrize("seed, lens", [(0, [1]), (1, [17, 5, 300, 16, 33]),
                                        (2, [64] * 8), (3, [2, 250, 3])])
def test_kernel_matches_the_torch_path(seed, lens, monkeypatch):
    case = _case(seed, lens)
    want = _run(case, False, monkeypatch)
    got = _run(case, True, monkeypatch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_takes_a_strided_query_and_no_group(monkeypatch):
    # q as the model makes it: a view into the fused qkv projection; Hq == Hkv
    case = list(_case(4, [40, 7], hq=4, hkv=4, dim=32))
    qkv = torch.randn(2, 4 * 32 + 2 * 4 * 32)
    case[0] = qkv[:, :128].view(2, 4, 32)
    assert not case[0].is_contiguous()
    torch.testing.assert_close(_run(case, True, monkeypatch), _run(case, False, monkeypatch),
                               rtol=1e-5, atol=1e-5)


def test_other_dtypes_take_the_torch_path():
    q, k, v, k_cache, v_cache, batch = _case(5, [9, 30])
    out = torch.empty_like(q)
    assert not pa._decode_in_place(q.double(), k_cache.double(), v_cache.double(), batch,
                                   out.double(), 0.125)


@needs_kernel
def test_fp32_cpu_decode_rows_use_the_kernel():
    q, k, v, k_cache, v_cache, batch = _case(6, [12, 3])
    out = torch.full_like(q, float("nan"))
    assert pa._decode_in_place(q, k_cache, v_cache, batch, out, 0.125)
    assert not out.isnan().any()


@pytest.mark.parametrize("continues", [False, True])
def test_cpu_prefill_chunks_take_the_fused_kernel(continues):
    """A prefill chunk (a whole prompt, or one continuing earlier context) attends through
    SDPA's fused CPU kernel, never its math path: with 3-D inputs the CPU fell back to the
    math path, and an 8k-token prompt's prefill took minutes on two cores. Checked on the
    profiler's op names (no timing), and against a plain reference."""
    torch.manual_seed(0)
    hq, hkv, dim, bs = 9, 3, 64, 16
    ctx, n = (96, 32) if continues else (48, 48)
    table = list(range(-(-ctx // bs)))
    k_cache = torch.randn(len(table) * bs, hkv, dim)
    v_cache = torch.randn(len(table) * bs, hkv, dim)
    batch = pa.AttentionBatch.build([], [(table, ctx, n)], bs)
    q, k, v = torch.randn(n, hq, dim), torch.randn(n, hkv, dim), torch.randn(n, hkv, dim)
    with torch.profiler.profile() as prof:
        out = pa.paged_attention(q, k, v, k_cache, v_cache, batch, 0.125)
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names, sorted(names)
    assert "aten::_scaled_dot_product_attention_math" not in names
    # reference: every query row at position ctx - n + i sees keys 0..that position
    keys = k_cache[:ctx].repeat_interleave(hq // hkv, 1)
    vals = v_cache[:ctx].repeat_interleave(hq // hkv, 1)
    for i in range(n):
        pos = ctx - n + i
        w = torch.softmax((keys[:pos + 1] * q[i]).sum(-1) * 0.125, dim=0)  # [pos+1, hq]
        ref = (w[..., None] * vals[:pos + 1]).sum(0)
        torch.testing.assert_close(out[i], ref, atol=1e-4, rtol=1e-4)
