"""The bandwidth-shaped decode kernels (kernels/fp8_gemv.py, kernels/awq_gemv.py) against kernels/quant_reference.py
(Triton's CPU interpreter without a GPU): shapes no tile divides (N past the last tile, K with a remainder of a
step), one row, three rows and sixteen, K unsplit and split (summed inside the kernel by the last split of each
tile, or by the second kernel), per-row and per-tensor FP8 scales.

Tolerances, relative to the product's norm: float32 activations 1e-6 (only the float32 sum's rounding); 16-bit
outputs the output's one rounding (bf16 8e-3, fp16 1e-3)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import (
    quant_cuda,  # noqa: E402
    splitk,  # noqa: E402
)
from kernels import quant_reference as qr  # noqa: E402
from kernels.awq_gemv import awq_gemv  # noqa: E402
from kernels.fp8_gemv import fp8_gemv  # noqa: E402
from tests.kernels.awq_cases import random_awq  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemv_equals_the_reference(dtype):
    """N = 40 leaves half a 16-row tile, K = 272 a remainder of a 64-byte step (in the last split); both kernels,
    rows that fill their tile and rows that do not."""
    n, k = 40, 272
    g = torch.Generator().manual_seed(3)
    wq, ws = qr.quantize_rows(torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None])
    wq, ws = wq.to(DEVICE), ws.to(DEVICE)
    exact = wq.double() * ws.double()[:, None]
    # the CUDA-core kernel at 1, 2 and 3 rows (its fourth accumulator on a clamped row) and 4; the dot kernel with
    # padded rows (3 and 5 of 16) and a full tile
    cases = [(m, "cuda-core", m if m < 3 else 4) for m in (1, 2, 3, 4)]
    cases += [(3, "dot", 16), (5, "dot", 16), (16, "dot", 16)]
    for m, kind, block_m in cases:
        x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
        want = x.double() @ exact.t()
        for splits, in_kernel in ((1, True), (3, True), (3, False)) if m == 1 else ((3, True),):
            cfg = dict(KIND=kind, BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=64, SPLITS=splits)
            got = fp8_gemv(x, wq, ws, config=cfg, in_kernel_sum=in_kernel)
            err = _rel(got, want)
            print(f"fp8_gemv {str(dtype)[6:]} m={m} {kind} splits={splits} in-kernel={in_kernel}: {err:.2e}")
            assert got.shape == (m, n) and got.dtype == dtype and err < TOL[dtype]
    for m in (1, 2, 3, 8, 16):  # the default tiles (CONFIGS) at each row count
        x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
        assert _rel(fp8_gemv(x, wq, ws), x.double() @ exact.t()) < TOL[dtype]
    # the in-kernel sum leaves every counter at zero for the next call (and for a replayed CUDA graph)
    assert int(splitk.tickets(torch.device(DEVICE), 1).count_nonzero()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemv_stream_equals_the_reference(dtype):
    """The one-row streaming kernel: N = 40 leaves half a 16-row tile (clamped rows, or TMA's zero fill), a grid
    of one program per tile and a grid smaller than the tiles (each program looping over several), pointer loads
    and TMA (on a GPU with the copy engine; the pointer path elsewhere), per-row and per-tensor scales; K = 272
    (not whole 64-byte steps) and two rows fall back to the CUDA-core kernel."""
    n, k = 40, 256
    g = torch.Generator().manual_seed(6)
    wq, ws = qr.quantize_rows(torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None])
    wq, ws = wq.to(DEVICE), ws.to(DEVICE)
    exact = wq.double() * ws.double()[:, None]
    x = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
    want = x.double() @ exact.t()
    for bn, ctas, tma in ((16, 0, False), (8, 1, False), (16, 0, True), (8, 1, True)):
        cfg = dict(KIND="stream", BLOCK_M=1, BLOCK_N=bn, BLOCK_K=64, STAGES=3, CTAS=ctas, TMA=tma, num_warps=4)
        got = fp8_gemv(x, wq, ws, config=cfg)
        err = _rel(got, want)
        print(f"fp8_gemv stream {str(dtype)[6:]} BLOCK_N={bn} CTAS={ctas} TMA={tma}: {err:.2e}")
        assert got.shape == (1, n) and got.dtype == dtype and err < TOL[dtype]
    scale = ws.amax().reshape(1)
    cfg = dict(KIND="stream", BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, STAGES=2, CTAS=1, TMA=True, num_warps=4)
    got = fp8_gemv(x, wq, scale, config=cfg)
    assert _rel(got, x.double() @ (wq.double() * scale.double()).t()) < TOL[dtype]
    for m, kk in ((1, 272), (2, 256)):  # not the stream kernel's shape: the CUDA-core kernel takes it
        wq2, ws2 = qr.quantize_rows(torch.randn(n, kk, generator=g))
        wq2, ws2 = wq2.to(DEVICE), ws2.to(DEVICE)
        x2 = torch.randn(m, kk, generator=g).to(dtype).to(DEVICE)
        got = fp8_gemv(x2, wq2, ws2, config=dict(KIND="stream", BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, STAGES=3))
        assert _rel(got, x2.double() @ (wq2.double() * ws2.double()[:, None]).t()) < TOL[dtype]


def test_fp8_gemv_per_tensor_scale_and_default_tiles():
    n, k = 48, 256
    g = torch.Generator().manual_seed(4)
    w = torch.randn(n, k, generator=g) * 0.1
    scale = (w.abs().amax() / qr.FP8_MAX).reshape(1)
    wq = (w / scale).to(qr.FP8)
    x = torch.randn(2, k, generator=g).to(DEVICE)
    got = fp8_gemv(x, wq.to(DEVICE), scale.to(DEVICE))
    want = x.double() @ (wq.double() * scale.double()).t().to(DEVICE)
    assert _rel(got, want) < 1e-6


def test_fp8_gemv_refuses_what_it_cannot_compute():
    wq, ws = qr.quantize_rows(torch.randn(8, 32))
    with pytest.raises(ValueError, match="at most 16 rows"):
        fp8_gemv(torch.randn(17, 32).to(DEVICE), wq.to(DEVICE), ws.to(DEVICE))
    with pytest.raises(ValueError, match="does not fit the 5 rows"):
        fp8_gemv(torch.randn(5, 32).to(DEVICE), wq.to(DEVICE), ws.to(DEVICE), config=dict(KIND="cuda-core", BLOCK_M=8))
    with pytest.raises(ValueError, match="do not fit"):
        fp8_gemv(torch.randn(1, 16).to(DEVICE), wq.to(DEVICE), ws.to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_awq_gemv_equals_the_reference(dtype):
    """N = 72 is nine packed words (a partial 32-column tile), K = 96 three groups of 32 split in three."""
    k, n, group = 96, 72, 32
    _, qweight, qzeros, scales = random_awq(k, n, group, dtype, seed=5)
    w = qr.awq_dequantize(qweight, qzeros, scales, group).double()
    for m in (1, 3):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
        want = x.double() @ w
        for splits, in_kernel in ((1, True), (3, True), (3, False)) if m == 1 else ((3, True),):
            cfg = dict(BLOCK_N=32, BLOCK_K=16, SPLITS=splits)
            got = awq_gemv(x, qweight, qzeros, scales, group, config=cfg, in_kernel_sum=in_kernel)
            err = _rel(got, want)
            print(f"awq_gemv {str(dtype)[6:]} m={m} splits={splits} in-kernel={in_kernel}: {err:.2e}")
            assert got.shape == (m, n) and got.dtype == dtype and err < TOL[dtype]
    assert int(splitk.tickets(torch.device(DEVICE), 1).count_nonzero()) == 0


def test_awq_gemv_every_nibble_lands_in_its_column():
    """One-hot rows of x pick single weight rows: each of a word's eight columns is its own nibble, with the
    largest values (q = 15 at the highest nibble uses the full 2^23 + 15 x 16^3 mantissa)."""
    k, n, group = 32, 16, 32
    q = torch.arange(k * n).reshape(k, n) % 16
    q[0] = 15
    z = torch.zeros(1, n, dtype=torch.long)
    z[0, ::3] = 15
    scales = (torch.arange(1, n + 1, dtype=torch.float32) / 64).reshape(1, n).to(DEVICE)
    qweight, qzeros = qr.pack_int4(q).to(DEVICE), qr.pack_int4(z).to(DEVICE)
    x = torch.eye(k)[[0, 5, 31]].to(DEVICE)
    got = awq_gemv(x, qweight, qzeros, scales, group, config=dict(BLOCK_N=16, BLOCK_K=32, SPLITS=1))
    want = qr.awq_dequantize(qweight, qzeros, scales, group)[[0, 5, 31]]
    assert torch.equal(got, want)


def test_the_gemv_kernel_set_routes_decode_rows_to_the_new_kernels(monkeypatch):
    """By default where the H200 decode table measured them fastest (FP8 at 1-16 rows, AWQ at 1 and 2 where a layer
    keeps the checkpoint's layout: test_quant_dispatch holds the defaults to the table); the "gemv" set's limits put
    them in front up to the kernels' own limits."""
    monkeypatch.setattr(quant_cuda, "KERNELS", "fast")
    assert [quant_cuda.fp8_path(m) for m in (1, 2, 16, 17)] == ["gemv", "gemv", "gemv", "scaled-mm"]
    assert [quant_cuda.awq_path(m) for m in (1, 2, 3)] == ["tc", "tc", "tc"]  # the engine's repacked GPU layers
    # a layer that keeps the checkpoint's layout: the decode GEMV at 1-2 rows
    assert [quant_cuda.awq_path(m, repacked=False) for m in (1, 2, 3)] == ["gemv2", "gemv2", "dot"]
    monkeypatch.setattr(quant_cuda, "FP8_GEMV_MAX_ROWS", quant_cuda.FP8_GEMV_ROWS_WHEN_ON)
    assert [quant_cuda.fp8_path(m) for m in (1, 16)] == ["gemv", "gemv"]
    assert quant_cuda.fp8_path(17) == "scaled-mm"
    wq, ws = qr.quantize_rows(torch.randn(24, 64, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = quant_cuda.fp8_linear(x.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE))
    assert _rel(got.cpu(), x.double() @ (wq.double() * ws.double()[:, None]).t()) < TOL[torch.bfloat16]
    _, qweight, qzeros, scales = random_awq(128, 32, 128, torch.float16, seed=9)
    x16 = torch.randn(1, 128, generator=torch.Generator().manual_seed(3)).half().to(DEVICE)
    got = quant_cuda.awq_linear(x16, qweight, qzeros, scales, 128)
    want = x16.double() @ qr.awq_dequantize(qweight, qzeros, scales, 128).double()
    assert _rel(got, want) < TOL[torch.float16]
    monkeypatch.setattr(quant_cuda, "KERNELS", "legacy")
    assert quant_cuda.fp8_path(1) == "scaled-mm" and quant_cuda.awq_path(1) == "legacy"
