"""The C layer ops (worker/models/layer_ops.py) against the torch code they replace."""

import pytest
import torch
import torch.nn.functional as F

from worker.models import layer_ops, native
from worker.models.rope import _rotate

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("kernel_threads")]

needs_kernel = pytest.mark.skipif(not native.has_avx2_fma(),
                                  reason="the layer-ops kernel needs x86-64 with AVX2 + FMA")


@needs_kernel
def test_library_builds_here():
    assert layer_ops.available()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 16, 70])
@pytest.mark.parametrize("width", [8, 576, 1000])
def test_rms_norm_matches_torch(rows, width):
    torch.manual_seed(rows + width)
    x, w = torch.randn(rows, width) * 3, torch.randn(width)
    got = layer_ops.rms_norm(x, w, 1e-5)
    want = F.rms_norm(x, (width,), w, 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 40])
def test_rms_norm_with_residual_adds_then_normalizes(rows):
    torch.manual_seed(rows)
    wide = torch.randn(rows, 96)
    x = wide[:, :64]  # strided rows
    residual, w = torch.randn(rows, 64), torch.randn(64)
    before = residual.clone()
    out, total = layer_ops.rms_norm(x, w, 1e-6, residual)
    torch.testing.assert_close(total, x + before, rtol=0, atol=0)
    torch.testing.assert_close(out, F.rms_norm(x + before, (64,), w, 1e-6), rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(residual, before)  # the residual input is not written


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_rope_in_place_on_views_of_a_packed_projection(tokens):
    torch.manual_seed(tokens)
    hq, hkv, d = 9, 3, 64
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d)
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    cos, sin = torch.randn(tokens, d), torch.randn(tokens, d)
    want_q = _rotate(q.clone(), cos[:, None], sin[:, None])
    want_k = _rotate(k.clone(), cos[:, None], sin[:, None])
    assert layer_ops.rope_(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)  # v untouched


def test_rope_declines_a_layout_it_does_not_take_and_changes_nothing():
    q = torch.randn(4, 2, 8).transpose(0, 1).contiguous().transpose(0, 1)  # heads not inner
    k = torch.randn(4, 1, 8)
    q0, k0 = q.clone(), k.clone()
    assert not layer_ops.rope_(q, k, torch.randn(4, 8), torch.randn(4, 8))
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert not layer_ops.rope_(k.double(), k.double(), torch.randn(4, 8), torch.randn(4, 8))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 20])
def test_silu_mul_matches_torch(rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536) * 4
    gate, up = gate_up.split(1536, dim=-1)
    torch.testing.assert_close(layer_ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5,
                               atol=1e-5)


def test_other_dtypes_fall_back():
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    assert layer_ops.rms_norm(x, torch.ones(16, dtype=torch.bfloat16), 1e-5) is None
    assert layer_ops.silu_mul(x) is None


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 31, 32, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_torch_at_every_batch(rows, bias):
    """Below LINEAR_MAX_ROWS the C kernel, from there torch's sgemm: the same result."""
    torch.manual_seed(rows)
    lin = layer_ops.Linear(576, 960, bias=bias)
    x = torch.randn(rows, 576)
    with torch.no_grad():
        got = lin(x)
        assert lin._call[2], "the kernel applies to this layer"
        want = F.linear(x, lin.weight, lin.bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_linear_follows_replaced_or_moved_weights_and_autograd():
    lin = layer_ops.Linear(16, 8)
    x = torch.randn(2, 16)
    with torch.no_grad():
        lin(x)
        lin.weight = torch.nn.Parameter(torch.randn(8, 16))  # a new tensor: a new address
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
        lin.double()  # _apply: the cached call is dropped, and float64 takes the torch path
        assert lin(x.double()).dtype == torch.float64
    lin.float()
    y = lin(x)  # autograd on: torch's op, so gradients flow
    y.sum().backward()
    assert lin.weight.grad is not None


def test_linear_declines_shapes_it_does_not_take():
    assert not layer_ops.linear_call(torch.randn(6, 16), None)  # N % 4
    assert not layer_ops.linear_call(torch.randn(8, 12), None)  # K % 8
    assert not layer_ops.linear_call(torch.randn(16, 8).t(), None)  # not contiguous
    lin = layer_ops.Linear(12, 6)
    with torch.no_grad():
        x = torch.randn(3, 12)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
