"""Fused RMSNorm(+residual) and SiLU-mul Triton kernels against kernels/reference.py and float64.

On CPU they run in Triton's interpreter (tests/kernels/conftest.py); the `gpu` test repeats them at
Llama-3-8B sizes.  Inputs are fresh random values, widths are not powers of two, rows are strided
views (as the fused projections hand them over), and outputs are poisoned with NaN first by using
fresh `torch.empty` buffers in the kernels: an unwritten element would show as NaN."""

from __future__ import annotations

import pytest
import torch

import kernels.fused_ops as fused_ops
from kernels import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _poisoned_empty(monkeypatch):
    """Make torch.empty / empty_like inside the kernels' wrappers return NaN-filled buffers."""
    real_empty, real_like = torch.empty, torch.empty_like

    def empty(*a, **k):
        t = real_empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def like(*a, **k):
        t = real_like(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(fused_ops.torch, "empty", empty)
    monkeypatch.setattr(fused_ops.torch, "empty_like", like)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols", [64, 96, 200])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, cols, with_residual, monkeypatch):
    g = torch.Generator().manual_seed(cols)
    base = torch.randn(7, cols + 32, generator=g).to(dtype).to(DEVICE)
    x = base[:, 16 : 16 + cols]  # a strided view
    residual = torch.randn(7, cols, generator=g).to(dtype).to(DEVICE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype).to(DEVICE)
    want, want_res = reference.rms_norm(x, weight, 1e-5, residual)
    _poisoned_empty(monkeypatch)
    got, got_res = fused_ops.rms_norm(x, weight, 1e-5, residual)
    assert not got.isnan().any() and got.shape == x.shape and got.dtype == dtype
    assert _rel(got, want) <= TOL[dtype]
    # float64 oracle of the same math
    xs = x.double() + (residual.double() if residual is not None else 0)
    oracle = weight.double() * xs / torch.sqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert _rel(got, oracle) <= 2 * TOL[dtype]
    if with_residual and (DEVICE == "cuda" or dtype != torch.bfloat16):
        assert torch.equal(got_res, want_res)  # the residual sum is rounded exactly as torch adds
    elif with_residual:  # Triton's CPU interpreter truncates float32 -> bfloat16 instead of rounding
        assert _rel(got_res, want_res) <= TOL[dtype]
    else:
        assert got_res is None and want_res is None


def test_rms_norm_over_heads_of_a_3d_tensor():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 32, generator=g).to(DEVICE)
    w = torch.randn(32, generator=g).to(DEVICE)
    got, _ = fused_ops.rms_norm(q, w, 1e-6)
    want, _ = reference.rms_norm(q, w, 1e-6)
    assert got.shape == q.shape and _rel(got, want) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols", [48, 160, 1100])
def test_silu_mul(dtype, cols, monkeypatch):
    g = torch.Generator().manual_seed(cols)
    gate_up = (2 * torch.randn(9, 2 * cols, generator=g)).to(dtype).to(DEVICE)
    want = reference.silu_mul(gate_up)
    _poisoned_empty(monkeypatch)
    got = fused_ops.silu_mul(gate_up)
    assert not got.isnan().any() and got.shape == (9, cols)
    assert _rel(got, want) <= TOL[dtype]
    gate, up = gate_up.double().chunk(2, -1)
    assert _rel(got, gate * torch.sigmoid(gate) * up) <= 2 * TOL[dtype]


def test_empty_batches_launch_nothing():
    w = torch.ones(64, device=DEVICE)
    assert fused_ops.rms_norm(torch.empty(0, 64, device=DEVICE), w, 1e-5)[0].shape == (0, 64)
    assert fused_ops.silu_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_llama3_sizes(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 4096, device="cuda", generator=g).to(dtype)
    r = torch.randn(8192, 4096, device="cuda", generator=g).to(dtype)
    w = torch.randn(4096, device="cuda", generator=g).to(dtype)
    got, got_r = fused_ops.rms_norm(x, w, 1e-5, r)
    want, want_r = reference.rms_norm(x, w, 1e-5, r)
    assert _rel(got, want) <= TOL[dtype] and torch.equal(got_r, want_r)
    gu = torch.randn(8192, 2 * 14336, device="cuda", generator=g).to(dtype)
    assert _rel(fused_ops.silu_mul(gu), reference.silu_mul(gu)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 32), (6, 1, 80)])
def test_rotary_in_place_on_strided_views(dtype, heads):
    hq, hk, d = heads
    g = torch.Generator().manual_seed(hq * d)
    positions = torch.tensor([0, 5, 3, 17, 99, 42, 7], device=DEVICE)
    t = positions.shape[0]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(128).float(), inv)
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype).to(DEVICE)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hk, d)  # strided views, as the attention layer has them
    orig_q = q.clone()
    want_q, want_k = reference.rotary(q.clone(), k.clone(), positions, cos, sin)
    v_before = qkv[:, (hq + hk) * d :].clone()
    got_q, got_k = fused_ops.rotary(q, k, positions, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    assert _rel(got_q, want_q) <= TOL[dtype] and _rel(got_k, want_k) <= TOL[dtype]
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before)  # v untouched
    # float64 oracle: rotation of each (x1, x2) pair by the position's angle
    ang = freqs.double().to(DEVICE)[positions][:, None, :]
    x1, x2 = orig_q.double()[..., : d // 2], orig_q.double()[..., d // 2 :]
    oracle = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], dim=-1)
    assert _rel(got_q, oracle) <= 2 * TOL[dtype]
