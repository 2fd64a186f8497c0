"""The AWQ in-register kernels (kernels/w4a16.py) against dequantize-then-matmul in float64: the one-row
CUDA-core loop and the tensor-core tiles (both operand orders), split and unsplit, at row counts around each
tile size, with column counts no tile divides (Triton's CPU interpreter without a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import quant_reference as qr  # noqa: E402
from kernels.w4a16 import w4a16_linear  # noqa: E402
from tests.kernels.awq_cases import random_awq  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("group", [32, 64])
def test_w4a16_equals_dequantize_then_matmul(dtype, group):
    k, n = 128, 72  # n: 9 packed words, a partial 32-column tile
    _, qweight, qzeros, scales = random_awq(k, n, group, dtype, seed=group)
    w = qr.awq_dequantize(qweight, qzeros, scales, group).double()
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    for m in (1, 2, 17, 37):  # one row, the CUDA-core loop's limit, one past a 16-row tile, three tiles
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
        want = x.double() @ w
        loops = [(True, False), (True, True)] + ([(False, False)] if m <= 2 else [])
        for use_dot, swap in loops:
            for splits in (1, 3) if m in (1, 17) else (1,):
                cfg = dict(BLOCK_M=16 if use_dot else 1, BLOCK_N=32, BLOCK_K=16, SWAP_AB=swap)
                got = w4a16_linear(x, qweight, qzeros, scales, group, use_dot=use_dot, config=cfg, splits=splits)
                err = float((got.double() - want).norm() / want.norm())
                print(f"w4a16 {str(dtype)[6:]} g={group} m={m} dot={use_dot} swap={swap} splits={splits}: {err:.2e}")
                assert got.dtype == dtype and got.shape == (m, n) and err < tol


def test_w4a16_float16_weight_is_the_references_bits():
    """With float16 activations the kernel's dequantized weight is exactly the reference's (x = one-hot rows
    pick single weight rows out of the product)."""
    k, n, group = 64, 48, 32
    _, qweight, qzeros, scales = random_awq(k, n, group, torch.float16, seed=7)
    eye = torch.eye(k, dtype=torch.float16, device=DEVICE)[:16]
    got = w4a16_linear(eye, qweight, qzeros, scales, group, config=dict(BLOCK_N=16, BLOCK_K=16), splits=1)
    want = qr.awq_dequantize(qweight, qzeros, scales, group).half()[:16]
    assert torch.equal(got, want)


def test_w4a16_default_tiles_keep_leading_dims_and_refuse_a_misfit():
    _, qweight, qzeros, scales = random_awq(128, 64, 64, torch.float32, seed=1)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    torch.testing.assert_close(
        w4a16_linear(x, qweight, qzeros, scales, 64),
        qr.awq_linear(x, qweight, qzeros, scales, 64),
        rtol=1e-5,
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="do not fit"):
        w4a16_linear(torch.randn(2, 64).to(DEVICE), qweight, qzeros, scales, 64)
    with pytest.raises(ValueError, match="must divide"):
        w4a16_linear(x, qweight, qzeros, scales, 64, config=dict(BLOCK_K=128))


@pytest.mark.gpu
def test_gpu_w4a16_llama3_shapes():
    """The 8B's projections with the default tiles at decode and prefill row counts."""
    for k, n in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
        _, qweight, qzeros, scales = random_awq(k, n, 128, torch.float16, seed=k + n)
        w = qr.awq_dequantize(qweight, qzeros, scales, 128)
        for m in (1, 2, 8, 16, 32, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            got = w4a16_linear(x, qweight, qzeros, scales, 128)
            want = x.float() @ w
            err = float((got.float() - want).norm() / want.norm())
            print(f"gpu w4a16 {k}x{n} m={m}: rel err {err:.2e}")
            assert err < 2e-3
