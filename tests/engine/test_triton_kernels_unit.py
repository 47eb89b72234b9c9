"""The device kernels (worker/models/triton_kernels.py) against plain-torch references:
on CPU tensors under Triton's interpreter here, on CUDA where there is one (-m cuda)."""

import math

import pytest
import torch
import torch.nn.functional as F

from worker.models import triton_kernels as tk
from worker.models.rope import _rotate

pytestmark = pytest.mark.unit
if not tk.available():
    pytest.skip("triton is not installed", allow_module_level=True)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _dev(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual(device, dtype):
    dev = _dev(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(dev, dtype)
    r = torch.randn(5, 96, generator=g).to(dev, dtype)
    w = torch.rand(96, generator=g).to(dev, dtype)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tk.rms_norm(x, w, 1e-6), F.rms_norm(x, (96,), w, 1e-6), **tol)
    out, total = tk.rms_norm(x, w, 1e-6, r)
    # exact in fp32; in bf16 one rounding step (the interpreter truncates where CUDA rounds)
    exact = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=0, rtol=8e-3)
    torch.testing.assert_close(total, x + r, **exact)
    torch.testing.assert_close(out, F.rms_norm(x + r, (96,), w, 1e-6), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul(device):
    dev = _dev(device)
    gu = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(dev)
    want = F.silu(gu[:, :1500]) * gu[:, 1500:]
    torch.testing.assert_close(tk.silu_mul(gu), want, atol=1e-5, rtol=1e-5)


def _rope_tables(max_pos, dim):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float(), emb.sin().float()


@pytest.mark.parametrize("device", DEVICES)
def test_rope_and_cache_rotates_q_in_place_and_writes_k_v_to_their_slots(device):
    dev = _dev(device)
    hq, hkv, d, t, slots = 6, 2, 16, 4, 40
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dev)
    original = qkv.clone()
    cos, sin = (x.to(dev) for x in _rope_tables(64, d))
    pos = torch.tensor([3, 0, 17, 63], dtype=torch.int32, device=dev)
    slot = torch.tensor([5, 39, 0, 22], dtype=torch.int32, device=dev)
    kc = torch.zeros(slots, hkv, d, device=dev)
    vc = torch.zeros(slots, hkv, d, device=dev)
    q = tk.rope_and_cache(qkv, hq, hkv, d, pos, cos, sin, slot, kc, vc)
    q0, k0, v0 = original.split([hq * d, hkv * d, hkv * d], dim=-1)
    c, s = cos[pos.long()][:, None], sin[pos.long()][:, None]
    torch.testing.assert_close(q, _rotate(q0.view(t, hq, d), c, s), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kc[slot.long()], _rotate(k0.view(t, hkv, d), c, s),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vc[slot.long()], v0.view(t, hkv, d), atol=0, rtol=0)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot.long().cpu()] = False
    assert kc[untouched.to(dev)].abs().sum() == 0


def _reference_attention(q, kc, vc, seqs, block_size, scale):
    """seqs: (block table, first token row, token count, first position) per sequence."""
    out = torch.zeros_like(q)
    hq, hkv = q.shape[1], kc.shape[1]
    for table, first, count, pos0 in seqs:
        n = pos0 + count
        slots = torch.tensor([table[i // block_size] * block_size + i % block_size
                              for i in range(n)])
        k = kc[slots].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, n, D]
        v = vc[slots].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        qs = q[first:first + count].transpose(0, 1)  # [Hq, count, D]
        mask = torch.arange(n)[None, :] <= (torch.arange(count)[:, None] + pos0)
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[first:first + count] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_reads_blocks_in_place_for_decode_and_prefill(device, group, dtype):
    dev = _dev(device)
    hkv, d, bs = 2, 32, 4
    hq = hkv * group
    g = torch.Generator().manual_seed(3)
    num_blocks = 30
    kc = torch.randn(num_blocks * bs, hkv, d, generator=g)
    vc = torch.randn(num_blocks * bs, hkv, d, generator=g)
    # two decode rows (contexts 9 and 1), a prefill chunk of 5 tokens after 6 cached, and
    # a fresh prompt of 7 tokens: block tables deliberately out of order
    seqs = [([7, 2, 19], 0, 1, 8), ([11], 1, 1, 0), ([3, 25, 4], 2, 5, 6),
            ([0, 29], 7, 7, 0)]
    t = 14
    q = torch.randn(t, hq, d, generator=g)
    scale = 1 / math.sqrt(d)
    want = _reference_attention(q, kc, vc, seqs, bs, scale)
    max_blocks = max(len(s[0]) for s in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(s[0])] = torch.tensor(s[0], dtype=torch.int32)
    per_tile = 2  # tiles of at most two query tokens: the prefill chunks span tiles
    tiles = []
    for i, (_, first, count, pos0) in enumerate(seqs):
        for j in range(0, count, per_tile):
            tiles.append([i, first + j, min(per_tile, count - j), pos0 + j])
    batch = tk.AttentionTiles(torch.tensor(tiles, dtype=torch.int32, device=dev),
                              tables.to(dev), per_tile, max_context=15)
    if dtype == torch.bfloat16:  # the reference on the same rounded inputs, in fp32
        q, kc, vc = (x.to(dtype).float() for x in (q, kc, vc))
        want = _reference_attention(q, kc, vc, seqs, bs, scale)
    got = tk.paged_attention(q.to(dev, dtype), kc.to(dev, dtype), vc.to(dev, dtype), batch, bs,
                             scale)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_apply_bitmask_matches_the_reference(device):
    from worker.guided.bitmask import reference_apply

    dev = _dev(device)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5000, generator=g)
    mask = torch.randint(-2**31, 2**31 - 1, (3, (5000 + 31) // 32), dtype=torch.int32,
                         generator=g)
    want = logits.clone()
    reference_apply(want, mask)
    got = logits.to(dev)
    tk.apply_bitmask(got, mask.to(dev))
    torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0)


def test_meta_tensors_only_make_outputs_and_are_counted():
    x = torch.empty(4, 64, device="meta")
    (out, total), counts = tk.count_kernels(tk.rms_norm, x, torch.empty(64, device="meta"),
                                            1e-6, x)
    assert out.shape == total.shape == (4, 64) and out.device.type == "meta"
    assert counts == {"rms_norm": 1}
    _, counts = tk.count_kernels(lambda: (x * 2).view(-1).sum())
    assert counts == {"aten.mul": 1, "aten.sum": 1}  # the view launches nothing
