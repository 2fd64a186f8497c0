"""AWQ int4: the packing order against AutoAWQ's definition, and the Triton dequant GEMM (decode and
prefill shapes, split-K) against the torch reference (Triton's CPU interpreter without a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import quant_reference as qr  # noqa: E402
from kernels.awq_gemm import GEMV_MAX_ROWS, awq_gemm  # noqa: E402
from tests.kernels.awq_cases import random_awq  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_packing_order_is_autoawqs():
    """AutoAWQ's WQLinear_GEMM.from_linear packs column ``8c + order_map[i]`` into bits ``4i..4i+3`` of
    word c, order_map = [0, 2, 4, 6, 1, 3, 5, 7] (awq/modules/linear/gemm.py); its dequantize_gemm undoes
    it with AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7] (awq/utils/packing_utils.py).  Columns 0..7 holding
    the values 1..8 must therefore give the word 0x86427531 (nibbles, low to high: 1,3,5,7,2,4,6,8)."""
    values = torch.arange(1, 9, dtype=torch.int32)[None, :]
    word = qr.pack_int4(values)
    assert word.item() == 0x86427531 - 2**32  # the same 32 bits, read as a signed int32
    assert qr.AWQ_NIBBLE_OF_COLUMN == (0, 4, 1, 5, 2, 6, 3, 7)
    g = torch.Generator().manual_seed(0)
    many = torch.randint(0, 16, (5, 64), generator=g)
    assert torch.equal(qr.unpack_int4(qr.pack_int4(many)), many.int())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [32, 128])
def test_gemm_equals_dequantize_then_matmul(dtype, group):
    k, n = 256, 72  # n: 9 packed words, not a multiple of any tile (the interpreter pays for every tile)
    _, qweight, qzeros, scales = random_awq(k, n, group, dtype, seed=group)
    w = qr.awq_dequantize(qweight, qzeros, scales, group).double()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for m in (1, 5, 37):  # decode rows (BLOCK_M 16), a small batch, a prefill chunk
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
        want = x.double() @ w
        for splits in (None, 1, 3, "dense", "gemv", "gemv-split"):
            if splits.__class__ is str and splits.startswith("gemv") and m > GEMV_MAX_ROWS + 1:
                # the GEMV path serves decode batches of up to GEMV_MAX_ROWS rows (one past it is still checked);
                # a prefill chunk through it took 15 of this test's 18 s in the interpreter
                continue
            if splits == "dense":  # the weight dequantized once, then a dense product
                got = awq_gemm(x, qweight, qzeros, scales, group, dense=True)
            elif splits.__class__ is str:  # one row per program on the CUDA cores
                cfg = dict(BLOCK_N=64, BLOCK_K=32)
                got = awq_gemm(
                    x,
                    qweight,
                    qzeros,
                    scales,
                    group,
                    gemv=True,
                    gemv_config=cfg,
                    splits=3 if splits == "gemv-split" else 1,
                )
            else:
                got = awq_gemm(x, qweight, qzeros, scales, group, splits=splits, dense=False, gemv=False)
            err = float((got.double() - want).norm() / want.norm())
            print(f"awq gemm {str(dtype)[6:]} g={group} m={m} splits={splits}: rel err {err:.2e}")
            assert got.dtype == dtype and got.shape == (m, n) and err < tol


def test_gemm_keeps_leading_dims_and_refuses_a_misfit():
    _, qweight, qzeros, scales = random_awq(128, 64, 64, torch.float32, seed=1)
    x = torch.randn(2, 3, 128).to(DEVICE)
    out = awq_gemm(x, qweight, qzeros, scales, 64)
    torch.testing.assert_close(out, qr.awq_linear(x, qweight, qzeros, scales, 64), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        awq_gemm(torch.randn(2, 64).to(DEVICE), qweight, qzeros, scales, 64)


def test_fp8_linear_reference_is_per_token_and_per_channel(monkeypatch):
    """The CPU path of --quantization fp8: weight rows use the e4m3 range each; so do activation rows, in a product
    of more than FP8_W8A16_MAX_ROWS rows (up to that boundary a product's rows stay in their own dtype, as on the
    GPU; the boundary is set here, since its default, 0, quantizes every row)."""
    monkeypatch.setattr(qr, "FP8_W8A16_MAX_ROWS", 8)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-2, 1, 48)[:, None]  # rows of very different sizes
    rows = qr.FP8_W8A16_MAX_ROWS + 5
    x = torch.randn(rows, 64, generator=g) * torch.logspace(-3, 2, rows)[:, None]
    wq, ws = qr.quantize_rows(w)
    assert wq.dtype == torch.float8_e4m3fn and ws.shape == (48,)
    want = x @ w.t()
    worst = {}
    for name, xs in (("per token", x), ("decode rows", x[:5])):
        y = qr.fp8_linear(xs, wq, ws)
        worst[name] = float((y - want[: len(xs)]).norm(dim=-1).div(want[: len(xs)].norm(dim=-1)).max())
    print(f"fp8 linear (reference): worst row relative error {worst}")
    assert worst["per token"] < 0.08  # two e4m3 roundings (3 mantissa bits each), averaged over 64 products
    assert worst["decode rows"] < 0.05  # the weight's rounding only


@pytest.mark.gpu
def test_gpu_awq_gemm_llama3_shapes():
    """Llama-3-8B's projections at decode (1, 16 rows) and prefill (256) sizes against dequantize + matmul."""
    for k, n in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
        _, qweight, qzeros, scales = random_awq(k, n, 128, torch.float16, seed=k + n)
        w = qr.awq_dequantize(qweight, qzeros, scales, 128)
        for m in (1, 16, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            got = awq_gemm(x, qweight, qzeros, scales, 128)
            want = x.float() @ w
            err = float((got.float() - want).norm() / want.norm())
            print(f"gpu awq {k}x{n} m={m}: rel err {err:.2e}")
            assert err < 2e-3


@pytest.mark.gpu
def test_gpu_fp8_linear_scaled_mm_matches_the_reference():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs compute capability 8.9+")
    from kernels import quant_cuda

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096, 4096, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    wq, ws = qr.quantize_rows(w)
    for m in (1, 7, 256):
        x = torch.randn(m, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
        keep = quant_cuda.fp8_keeps_activations(m)  # the decode kernel leaves the activations in 16 bits
        got, want = quant_cuda.fp8_linear(x, wq, ws), qr.fp8_linear(x, wq, ws, keep_activations=keep)
        err = float((got.float() - want.float()).norm() / want.float().norm())
        print(f"gpu fp8 linear m={m} ({quant_cuda.fp8_path(m)}): rel err vs reference {err:.2e}")
        assert err < 1e-2
