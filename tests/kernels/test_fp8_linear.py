"""FP8 weights' Triton kernels against the torch reference (Triton's CPU interpreter without a GPU, the real
kernels with one): the per-token activation quantization byte for byte, and the small-M W8A16 product in
both inner loops, split and unsplit, on shapes no tile divides."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import quant_reference as qr  # noqa: E402
from kernels.fp8_linear import quantize_per_token, w8a16_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [64, 100, 300])
def test_quantize_per_token_equals_the_reference_bytes(dtype, k):
    """Rows of very different sizes, one all zeros (its scale is the 1e-12 floor), in one pass and in chunks."""
    g = torch.Generator().manual_seed(k)
    sizes = torch.tensor([1e-3, 1.0, 10.0, 300.0, 0.0])[:, None]
    x = (torch.randn(5, k, generator=g) * sizes).to(dtype).to(DEVICE)
    want_q, want_s = qr.quantize_per_token(x)
    # the row kernel: the whole row in registers, or two passes over 32-element chunks; the tile kernel: its
    # default, 2 and 4 rows per program (the last program's rows past the end masked), in one or two passes
    tiles = [dict(ROWS=1, BLOCK=32), dict(ROWS=2, BLOCK=512), dict(ROWS=4, BLOCK=64)]
    for block, config in [(None, None), (32, None)] + [(None, c) for c in tiles]:
        q, s = quantize_per_token(x, block=block, config=config)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 1) and s.dtype == torch.float32
        assert torch.equal(s, want_s)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_quantize_per_token_reads_a_strided_view():
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1)).to(DEVICE)[:, :96]
    q, s = quantize_per_token(x)
    want_q, want_s = qr.quantize_per_token(x)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]
    wq, ws = qr.quantize_rows(w)
    return wq.to(DEVICE), ws.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_w8a16_equals_the_dequantized_product(dtype):
    """x @ (wq x ws)^T: exact products of e4m3 and x, summed in float32, rounded once to x's dtype.  n=40 and
    k=80 leave partial tiles on both sides (BLOCK_N 16, BLOCK_K 32)."""
    n, k = 40, 80
    wq, ws = _weight(n, k, seed=3)
    w = wq.double() * ws.double()[:, None]
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for m in (1, 2, 3, 5, 17):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
        want = x.double() @ w.t()
        for use_dot in (False, True):
            for splits in (1, 2):
                cfg = dict(BLOCK_N=16, BLOCK_K=32) if use_dot else dict(BLOCK_K=32)
                got = w8a16_linear(x, wq, ws, use_dot=use_dot, config=cfg, splits=splits)
                err = float((got.double() - want).norm() / want.norm())
                print(f"w8a16 {str(dtype)[6:]} m={m} dot={use_dot} splits={splits}: rel err {err:.2e}")
                assert got.dtype == dtype and got.shape == (m, n) and err < tol


def test_w8a16_default_dispatch_keeps_leading_dims_and_refuses_a_misfit():
    wq, ws = _weight(48, 64, seed=4)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    got = w8a16_linear(x, wq, ws)
    want = x @ (wq.float() * ws[:, None]).t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        w8a16_linear(torch.randn(2, 32).to(DEVICE), wq, ws)


@pytest.mark.gpu
def test_gpu_w8a16_and_quantization_at_llama3_shapes():
    """The 8B's projections with the default tiles: the W8A16 product against the dequantized weight, and
    the fused quantization byte for byte against torch's."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 conversions need compute capability 8.9+")
    for k, n in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = qr.quantize_rows(w)
        dense = wq.float() * ws[:, None]
        for m in (1, 2, 8, 16, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            got = w8a16_linear(x, wq, ws)
            want = x.float() @ dense.t()
            err = float((got.float() - want).norm() / want.norm())
            print(f"gpu w8a16 {k}x{n} m={m}: rel err {err:.2e}")
            assert err < 8e-3
        x = torch.randn(300, k, device="cuda", dtype=torch.bfloat16) * 3
        q, s = quantize_per_token(x)
        want_q, want_s = qr.quantize_per_token(x)
        assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
