"""The tensor-core AWQ kernel (kernels/w4a16_tc.py) and its load-time layout against dequantize-then-matmul in
float64: both operand orders, split and unsplit (the splits summed by a second kernel or inside this one), groups of
one plane to one block and more, row and column counts no tile divides (Triton's CPU interpreter without a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import quant_reference as qr  # noqa: E402
from kernels.w4a16_tc import awq_repack, awq_unrepack, w4a16_tc  # noqa: E402
from tests.kernels.awq_cases import random_awq  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_repack_round_trips_and_keeps_the_size():
    q, qweight, qzeros, _ = random_awq(256, 24, 64, torch.float16, seed=1)
    packed, zf = awq_repack(qweight, qzeros, 64)
    assert packed.shape == (32, 24) and packed.dtype == torch.int32 and zf.dtype == torch.float16
    assert torch.equal(awq_unrepack(packed).cpu(), q.to(torch.int32))
    # nibble p of word (b * 16 + r, n) is W[b * 128 + p * 16 + r, n]
    assert int((packed[16 + 3, 5] >> 8) & 0xF) == int(q[128 + 2 * 16 + 3, 5])
    assert torch.equal(zf.float().cpu() - 1024, qr.unpack_int4(qzeros).float().cpu())
    with pytest.raises(ValueError, match="multiple of 128"):
        awq_repack(qweight[:64], qzeros[:1], 64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [32, 128, 256])
def test_w4a16_tc_equals_dequantize_then_matmul(dtype, group):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's CPU interpreter has no bfloat16 tl.dot (numpy has no bfloat16): checked on the GPU")
    k, n = 256, 40  # n: a partial 32-column tile
    _, qweight, qzeros, scales = random_awq(k, n, group, dtype, seed=group)
    packed, zf = awq_repack(qweight, qzeros, group)
    w = qr.awq_dequantize(qweight, qzeros, scales, group).double()
    tol = 1e-6 if dtype == torch.float32 else 1e-3 if dtype == torch.float16 else 8e-3
    for m in (3, 17):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
        want = x.double() @ w
        for swap, one_dot, splits, in_kernel in (
            (True, True, 1, False),
            (False, True, 2, True),
            (True, False, 2, False),
            (True, False, 2, True),
            (False, False, 1, False),
        ):
            cfg = dict(BLOCK_M=16, BLOCK_N=32, SWAP_AB=swap, ONE_DOT=one_dot, IN_KERNEL=in_kernel)
            got = w4a16_tc(x, packed, zf, scales, group, config=cfg, splits=splits)
            err = float((got.double() - want).norm() / want.norm())
            print(
                f"w4a16_tc {str(dtype)[6:]} g={group} m={m} swap={swap} one_dot={one_dot} splits={splits} "
                f"in-kernel={in_kernel}: {err:.2e}"
            )
            assert got.dtype == dtype and got.shape == (m, n) and err < tol


def test_w4a16_tc_float16_weight_is_the_references_bits():
    """float16 activations: one-hot rows pick weight rows out of the product, bit for bit the reference's."""
    k, n, group = 128, 16, 128
    _, qweight, qzeros, scales = random_awq(k, n, group, torch.float16, seed=7)
    packed, zf = awq_repack(qweight, qzeros, group)
    eye = torch.eye(k, dtype=torch.float16, device=DEVICE)[::8]
    got = w4a16_tc(eye, packed, zf, scales, group, config=dict(BLOCK_M=16, BLOCK_N=16, SWAP_AB=True), splits=1)
    want = qr.awq_dequantize(qweight, qzeros, scales, group).half()[::8]
    assert torch.equal(got, want)


def test_w4a16_tc_whole_tiles_without_masks():
    """EVEN: where M and N are multiples of the tile, the loads drop their masks; the same product (and where they
    are not, the option falls back to the masked loads)."""
    k, n, group = 256, 64, 128
    _, qweight, qzeros, scales = random_awq(k, n, group, torch.float16, seed=11)
    packed, zf = awq_repack(qweight, qzeros, group)
    w = qr.awq_dequantize(qweight, qzeros, scales, group).double()
    for m in (16, 5):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half().to(DEVICE)
        plain = w4a16_tc(x, packed, zf, scales, group, config=dict(BLOCK_M=16, BLOCK_N=32), splits=2)
        even = w4a16_tc(x, packed, zf, scales, group, config=dict(BLOCK_M=16, BLOCK_N=32, EVEN=True), splits=2)
        assert torch.equal(plain, even)
        want = x.double() @ w
        assert float((even.double() - want).norm() / want.norm()) < 1e-3


def test_w4a16_tc_keeps_leading_dims_and_refuses_a_misfit():
    _, qweight, qzeros, scales = random_awq(128, 32, 64, torch.float32, seed=2)
    packed, zf = awq_repack(qweight, qzeros, 64)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    torch.testing.assert_close(
        w4a16_tc(x, packed, zf, scales, 64, config=dict(BLOCK_M=16, BLOCK_N=32)),
        qr.awq_linear(x, qweight, qzeros, scales, 64),
        rtol=1e-5,
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="do not fit"):
        w4a16_tc(torch.randn(2, 64).to(DEVICE), packed, zf, scales, 64)


@pytest.mark.gpu
def test_gpu_w4a16_tc_llama3_shapes():
    """The 8B's projections with the default tiles (the paired float16 dequantization): the reference's float16
    weight bit for bit, and the product within the float16 output's rounding; bfloat16 activations too."""
    for k, n in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
        _, qweight, qzeros, scales = random_awq(k, n, 128, torch.float16, seed=k + n)
        packed, zf = awq_repack(qweight, qzeros, 128)
        w = qr.awq_dequantize(qweight, qzeros, scales, 128)
        eye = torch.eye(k, dtype=torch.float16, device="cuda")[:: k // 64]
        assert torch.equal(w4a16_tc(eye, packed, zf, scales, 128), w.half()[:: k // 64])
        for m, dtype in ((3, torch.float16), (16, torch.float16), (32, torch.bfloat16), (100, torch.float16)):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            got = w4a16_tc(x, packed, zf, scales.to(dtype), 128)
            want = x.float() @ qr.awq_dequantize(qweight, qzeros, scales.to(dtype), 128)
            err = float((got.float() - want).norm() / want.norm())
            print(f"gpu w4a16_tc {k}x{n} m={m} {dtype}: rel err {err:.2e}")
            assert got.dtype == dtype and err < (2e-3 if dtype == torch.float16 else 8e-3)
        # the dequantization two words at a time (WORD_PAIRS) and the unmasked whole tiles (EVEN): the reference's
        # weight bit for bit at the small-M and the large-M tiles
        for rows in (16, 64, 256):
            eye = torch.eye(k, dtype=torch.float16, device="cuda")[:: k // rows]
            for opts in (dict(WORD_PAIRS=True), dict(EVEN=True), dict(WORD_PAIRS=True, EVEN=True)):
                got = w4a16_tc(eye, packed, zf, scales, 128, config=opts)
                assert torch.equal(got, w.half()[:: k // rows]), (k, n, rows, opts)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [32, 128])
def test_tc_dequantize_is_the_references_weight(dtype, group):
    """The repacked weight dequantized for the many-row products (the layer keeps no other copy): bit for bit the
    reference's weight in the activation dtype, a partial column tile included."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's CPU interpreter has no bfloat16 (numpy has none): checked on the GPU")
    from kernels.w4a16_tc import tc_dequantize

    k, n = 256, 264  # n: one full 256-column tile and a partial one
    _, qweight, qzeros, scales = random_awq(k, n, group, dtype, seed=group + 7)
    packed, zf = awq_repack(qweight, qzeros, group)
    got = tc_dequantize(packed, zf, scales, group, dtype)
    want = qr.awq_dequantize(qweight, qzeros, scales, group).to(dtype)
    assert got.dtype == dtype and got.shape == (k, n) and torch.equal(got, want)
