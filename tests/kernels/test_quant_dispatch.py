"""kernels/quant_cuda.py: which kernel each row count takes, and every path against the torch reference
(Triton's interpreter and torch's CPU ``_scaled_mm`` without a GPU), including the per-tensor fallback
where row-wise ``_scaled_mm`` is refused and the legacy kernel set the device benchmark A/Bs against."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from kernels import quant_cuda  # noqa: E402
from kernels import quant_reference as qr  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_fp8_rule_by_rows(monkeypatch):
    monkeypatch.setattr(quant_cuda, "KERNELS", "fast")
    monkeypatch.setattr(quant_cuda, "FP8_GEMV_MAX_ROWS", 0)  # the decode GEMV's own test: test_quant_gemv
    monkeypatch.setattr(qr, "FP8_W8A16_MAX_ROWS", 16)
    monkeypatch.setattr(quant_cuda, "FP8_CUDA_CORE_MAX_ROWS", 2)
    assert [quant_cuda.fp8_path(m) for m in (1, 2, 3, 16, 17, 4096)] == [
        "w8a16-cuda-core",
        "w8a16-cuda-core",
        "w8a16-dot",
        "w8a16-dot",
        "scaled-mm",
        "scaled-mm",
    ]
    monkeypatch.setattr(quant_cuda, "KERNELS", "legacy")
    assert {quant_cuda.fp8_path(m) for m in (1, 8, 4096)} == {"scaled-mm"}


def test_awq_rule_by_rows(monkeypatch):
    monkeypatch.setattr(quant_cuda, "KERNELS", "fast")
    monkeypatch.setattr(quant_cuda, "AWQ_GEMV2_MAX_ROWS", 0)  # the decode GEMV's own test: test_quant_gemv
    monkeypatch.setattr(quant_cuda, "AWQ_GEMV_MAX_ROWS", 1)
    monkeypatch.setattr(quant_cuda, "AWQ_CUDA_CORE_MAX_ROWS", 2)
    monkeypatch.setattr(quant_cuda, "AWQ_DENSE_MIN_ROWS", 512)
    monkeypatch.setattr(quant_cuda, "AWQ_TC_DENSE_MIN_ROWS", 300)
    # a layer with the repacked weight (the engine's GPU layers) reads only that: the tensor-core GEMM, then the
    # repacked weight dequantized for cuBLAS
    assert [quant_cuda.awq_path(m) for m in (1, 2, 3, 299, 300, 4096)] == ["tc"] * 4 + ["dequantize-cublas"] * 2
    # ... and a wide layer (the 8B's gate_up) the tensor-core GEMM again from AWQ_TC_WIDE_MIN_ROWS to _MAX_ROWS
    monkeypatch.setattr(quant_cuda, "AWQ_TC_WIDE_MIN_ROWS", 400)
    monkeypatch.setattr(quant_cuda, "AWQ_TC_WIDE_MAX_ROWS", 500)
    monkeypatch.setattr(quant_cuda, "AWQ_TC_WIDE_MIN_N", 1000)
    assert [quant_cuda.awq_path(m, n=1000) for m in (299, 300, 399, 400, 500, 501)] == [
        "tc",
        "dequantize-cublas",
        "dequantize-cublas",
        "tc",
        "tc",
        "dequantize-cublas",
    ]
    assert quant_cuda.awq_path(450, n=999) == quant_cuda.awq_path(450) == "dequantize-cublas"
    assert quant_cuda.awq_path(450, repacked=False, n=1000) == "dot"  # the checkpoint's layout: by rows alone
    # a layer without the repacked weight (not on the GPU, or float32 activations) keeps the paths around it
    assert [quant_cuda.awq_path(m, repacked=False) for m in (1, 2, 3, 256, 511, 512, 4096)] == [
        "gemv",
        "cuda-core",
        "dot",
        "dot",
        "dot",
        "dequantize-cublas",
        "dequantize-cublas",
    ]
    monkeypatch.setattr(quant_cuda, "KERNELS", "legacy")
    assert quant_cuda.awq_path(1) == quant_cuda.awq_path(4) == quant_cuda.awq_path(4096) == "legacy"


# the path names of kernels/quant_cuda.py and the columns of benchmarks/quant_kernels.py's table that time them
FP8_COLUMNS = {
    "gemv": "fp8_gemv_ms",
    "scaled-mm": "fp8_scaled_mm_ms",
    "w8a16-cuda-core": "fp8_w8a16_cuda_core_ms",
    "w8a16-dot": "fp8_w8a16_dot_ms",
}
AWQ_COLUMNS = {
    "gemv2": "awq_gemv2_ms",
    "gemv": "awq_legacy_ms",
    "cuda-core": "awq_cuda_core_ms",
    "dot": "awq_dot_ms",
    "tc": None,  # the tile tc_config picks at that M: awq_tc[<label>]_ms of the tc sweep (_tc_column)
    "dequantize-cublas": "awq_dequantize_cublas_ms",
}


def _tc_column(m: int) -> str:
    """The tc sweep's column for kernels/w4a16_tc.py's default tile at `m` rows (benchmarks/quant_kernels.py's
    tc_label: s<BLOCK_M>x<BLOCK_N>w<warps>s<stages>v<waves>, p16 for a dot per nibble plane, k for the splits summed
    in the kernel)."""
    from kernels.w4a16_tc import tc_config

    c = tc_config(m, 4096, 4096)
    label = f"s{c['BLOCK_M']}x{c['BLOCK_N']}w{c['num_warps']}s{c['num_stages']}v{c.get('WAVES', 2)}"
    return f"awq_tc[{label}{'' if c.get('ONE_DOT', True) else 'p16'}{'k' if c.get('IN_KERNEL') else ''}]_ms"


def test_the_default_rule_takes_the_fastest_path_the_device_run_measured(monkeypatch):
    """At each row count the device tables timed, the default boundaries pick a path within 5 % of the fastest
    for the 8B's four projections together (a path the table did not time at that M cannot be picked): the decode
    row counts from the H200 decode table (it times the decode GEMVs), the others from the H100 table; AWQ from 1 to
    64 rows from the H200 tensor-core sweep of the small-M tiles, from 128 to 256 from the sweep of the large-M tiles
    (their default tiles, kernels/w4a16_tc.py's tc_config), each projection by its own path (the repacked layer's
    path depends on its width)."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "benchmarks/results"
    decode = json.loads((results / "quant-kernels-h200-2026-11-28b-decode.json").read_text())["rows"]
    decode_ms = {r["M"] for r in decode}
    full = json.loads((results / "quant-kernels-h100-2026-11-27.json").read_text())["rows"]
    rows = decode + [r for r in full if r["M"] not in decode_ms]
    # AWQ at M = 1..64 from the small-M sweep, 128..256 from the earlier one (each times the dot and the dequantized
    # path beside its tiles)
    small = json.loads((results / "quant-kernels-h200-2026-11-28d-tc.json").read_text())["rows"]
    earlier = json.loads((results / "quant-kernels-h200-2026-11-28g-tc.json").read_text())["rows"]
    tc = small + [r for r in earlier if r["M"] > 64]
    tc_ms = {r["M"] for r in tc}
    awq_rows = tc + [r for r in rows if r["M"] not in tc_ms]
    monkeypatch.setattr(quant_cuda, "KERNELS", "fast")
    for path_of, columns, table in (
        (lambda m, n: quant_cuda.fp8_path(m), FP8_COLUMNS, rows),
        (lambda m, n: quant_cuda.awq_path(m, n=n), AWQ_COLUMNS, awq_rows),
    ):
        for m in sorted({r["M"] for r in table}):
            at_m = [r for r in table if r["M"] == m]
            cols = {p: (c or _tc_column(m)) for p, c in columns.items()}
            totals = {p: sum(r[c] for r in at_m) for p, c in cols.items() if all(c in r for r in at_m)}
            chosen = {r["layer"]: path_of(m, r["N"]) for r in at_m}
            missing = {r["layer"]: chosen[r["layer"]] for r in at_m if cols[chosen[r["layer"]]] not in r}
            assert not missing, f"M={m}: {missing} not timed"
            chosen_ms = sum(r[cols[chosen[r["layer"]]]] for r in at_m)
            assert chosen_ms <= 1.05 * min(totals.values()), f"M={m}: {chosen} {chosen_ms} {totals}"


def _fp8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * 0.05
    wq, ws = qr.quantize_rows(w)
    return wq.to(DEVICE), ws.to(DEVICE)


@pytest.mark.parametrize("kernels", ["fast", "legacy"])
def test_fp8_linear_every_path_matches_the_reference(monkeypatch, kernels):
    """Decode rows (the W8A16 kernels; the reference computes the same product) and a prefill chunk (the Triton
    quantization + _scaled_mm: the reference's per-token arithmetic).  The legacy set quantizes every product."""
    monkeypatch.setattr(quant_cuda, "KERNELS", kernels)
    monkeypatch.setattr(qr, "FP8_W8A16_MAX_ROWS", 4)
    monkeypatch.setattr(quant_cuda, "FP8_GEMV_MAX_ROWS", 0)  # the W8A16 kernels at 1 row (the GEMV: test_quant_gemv)
    wq, ws = _fp8_weight(48, 64)
    exact = wq.double() * ws.double()[:, None]
    for m in (1, 3, 9):
        x = torch.randn(2, m, 64, generator=torch.Generator().manual_seed(m)).bfloat16().to(DEVICE)[0]
        got = quant_cuda.fp8_linear(x, wq, ws)
        want = x.double() @ exact.t()
        assert got.shape == (m, 48) and got.dtype == torch.bfloat16
        err = float((got.double() - want).norm() / want.norm())
        path = quant_cuda.fp8_path(m)
        print(f"fp8 {kernels} m={m} ({path}): rel err {err:.2e} against the unquantized activations")
        assert path == ("scaled-mm" if kernels == "legacy" or m > 4 else "w8a16-cuda-core" if m == 1 else "w8a16-dot")
        if path == "scaled-mm":
            xq, xs = qr.quantize_per_token(x)
            per_token = (xq.double() * xs.double()) @ exact.t()
            torch.testing.assert_close(got.double(), per_token, rtol=1e-2, atol=1e-2)
            assert 5e-3 < err < 0.05  # the activations' e4m3 rounding shows
        else:
            torch.testing.assert_close(got, qr.fp8_linear(x, wq, ws), rtol=1e-2, atol=1e-2)
            assert err < 5e-3  # only the output's bf16 rounding


@pytest.mark.parametrize("kernels", ["fast", "gemv", "legacy"])
def test_each_default_path_matches_the_reference_of_its_own_activations(monkeypatch, kernels):
    """What the GPU test of the default rule checks (tests/kernels/test_awq_gemm.py), here under the interpreter:
    at every row count the default path matches quant_reference.fp8_linear with the activations kept where the
    path keeps them (the decode GEMV) and quantized where it quantizes them, and not the other product."""
    monkeypatch.setattr(quant_cuda, "KERNELS", kernels)
    if kernels == "gemv":
        monkeypatch.setattr(quant_cuda, "FP8_GEMV_MAX_ROWS", quant_cuda.FP8_GEMV_ROWS_WHEN_ON)
    wq, ws = _fp8_weight(48, 64)
    for m in (1, 2, 17):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).bfloat16().to(DEVICE)
        keep = quant_cuda.fp8_keeps_activations(m)
        assert keep == (kernels != "legacy" and m <= quant_cuda.FP8_GEMV_MAX_ROWS), (kernels, m)
        got = quant_cuda.fp8_linear(x, wq, ws).double()
        own, other = (qr.fp8_linear(x, wq, ws, keep_activations=k).double() for k in (keep, not keep))
        err, err_other = (float((got - w).norm() / w.norm()) for w in (own, other))
        path = quant_cuda.fp8_path(m)
        print(f"fp8 {kernels} m={m} ({path}): rel err {err:.2e}, against the other product {err_other:.2e}")
        assert err < 1e-2 and err_other > 2 * err  # the GPU test's bound; bf16 outputs either way


def test_fp8_linear_per_tensor_fallback(monkeypatch):
    """Where row-wise scaling is refused, unit scales and both row-wise scales applied to a float32 product: the same
    product as the row-wise one, and the reference's.  On a GPU the FP8 tensor cores sum with fewer bits than float32
    (on one H200 both products were 1.2e-4 from the reference with the very same quantized operands, and 1e-7 from
    each other), so there the reference is met within 1e-3 of the product's norm; on the CPU within 1e-5."""
    monkeypatch.setattr(quant_cuda, "KERNELS", "fast")
    monkeypatch.setattr(qr, "FP8_W8A16_MAX_ROWS", 0)
    monkeypatch.setattr(quant_cuda, "FP8_GEMV_MAX_ROWS", 0)  # the 5 rows take _scaled_mm, not the decode GEMV
    wq, ws = _fp8_weight(32, 64)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = quant_cuda.fp8_linear(x, wq, ws)
    monkeypatch.setitem(quant_cuda._ROWWISE, (x.device, x.dtype), None)
    got = quant_cuda.fp8_linear(x, wq, ws)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    reference = qr.fp8_linear(x, wq, ws)
    if x.is_cuda:
        rel = float((got.double() - reference.double()).norm() / reference.double().norm())
        assert rel < 1e-3, rel
    else:
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", ["fast", "legacy"])
def test_awq_linear_every_path_matches_the_reference(monkeypatch, kernels):
    monkeypatch.setattr(quant_cuda, "KERNELS", kernels)
    monkeypatch.setattr(quant_cuda, "AWQ_DENSE_MIN_ROWS", 20)
    g = torch.Generator().manual_seed(3)
    k, n, group = 64, 32, 32
    qweight = qr.pack_int4(torch.randint(0, 16, (k, n), generator=g)).to(DEVICE)
    qzeros = qr.pack_int4(torch.randint(0, 16, (k // group, n), generator=g)).to(DEVICE)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).to(DEVICE)
    for m in (1, 3, 24):  # cuda-core, dot, dequantize-cublas
        x = torch.randn(m, k, generator=g).to(DEVICE)
        got = quant_cuda.awq_linear(x, qweight, qzeros, scales, group)
        torch.testing.assert_close(got, qr.awq_linear(x, qweight, qzeros, scales, group), rtol=1e-5, atol=1e-5)


def test_kernel_set_is_checked_at_import():
    env = {**os.environ, "PAGEKEEPER_QUANT_KERNELS": "fastest"}
    proc = subprocess.run([sys.executable, "-c", "import kernels.quant_cuda"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "PAGEKEEPER_QUANT_KERNELS='fastest'" in proc.stderr


def test_fast_accumulation_only_up_to_its_k(monkeypatch):
    """_scaled_mm accumulates in the tensor cores' own precision only where K <= FP8_FAST_ACCUM_MAX_K (4096: the
    8B's qkv, o and gate_up; down_proj's 14,336 keeps the float32 promotion), in the row-wise and fallback calls."""
    calls: list[bool] = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(kwargs.get("use_fast_accum", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    for k, rowwise in ((64, True), (64, False), (96, True)):
        monkeypatch.setattr(quant_cuda, "FP8_FAST_ACCUM_MAX_K", 64)
        wq, ws = _fp8_weight(16, k)
        xq, xs = qr.quantize_per_token(torch.randn(5, k, generator=torch.Generator().manual_seed(k)).to(DEVICE))
        if not rowwise:
            monkeypatch.setitem(quant_cuda._ROWWISE, (xq.device, torch.float32), None)
        calls.clear()
        got = quant_cuda.scaled_mm(xq, xs, wq, ws, torch.float32)
        want = (xq.double() * xs.double()) @ (wq.double() * ws.double()[:, None]).t()
        torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-3)
        assert calls[-1] is (k <= 64)


def test_quant_tiles_by_shape():
    """kernels/fp8_linear.py's tile table (quant-profile-h200-2026-11-28.json): one pass up to 4,096 wide; a
    14,336-wide row held whole below 1,024 rows and read in two passes of 2,048 from there."""
    from kernels.fp8_linear import quant_config

    assert quant_config(256, 4096) == dict(ROWS=1, BLOCK=4096, num_warps=8)
    assert quant_config(8192, 4096) == dict(ROWS=1, BLOCK=4096, num_warps=8)
    assert quant_config(8, 100) == dict(ROWS=1, BLOCK=128, num_warps=4)
    assert quant_config(256, 14336) == dict(ROWS=1, BLOCK=16384, num_warps=16)
    assert quant_config(8192, 14336) == dict(ROWS=2, BLOCK=2048, num_warps=8)
    assert quant_config(16, 40000) == dict(ROWS=2, BLOCK=2048, num_warps=8)


def test_awq_linear_takes_the_repacked_weight_where_the_rule_says(monkeypatch):
    """A layer with kernels/w4a16_tc.py's layout (the engine makes it at load on the GPU and drops the checkpoint's
    qweight and qzeros): below the boundary the tensor-core GEMM, from it the repacked weight dequantized, for 16-bit
    and float32 activations alike; no product needs the checkpoint's layout; all match the reference."""
    from kernels.w4a16_tc import awq_repack

    monkeypatch.setattr(quant_cuda, "KERNELS", "fast")
    monkeypatch.setattr(quant_cuda, "AWQ_TC_DENSE_MIN_ROWS", 10)
    calls: list[int] = []
    real = quant_cuda.w4a16_tc
    monkeypatch.setattr(quant_cuda, "w4a16_tc", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    g = torch.Generator().manual_seed(4)
    k, n, group = 128, 32, 32
    qweight = qr.pack_int4(torch.randint(0, 16, (k, n), generator=g)).to(DEVICE)
    qzeros = qr.pack_int4(torch.randint(0, 16, (k // group, n), generator=g)).to(DEVICE)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).half().to(DEVICE)
    repacked = awq_repack(qweight, qzeros, group)
    for m, dtype in ((1, torch.float16), (5, torch.float16), (5, torch.float32), (12, torch.float16)):
        x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
        got = quant_cuda.awq_linear(x, None, None, scales.to(dtype), group, repacked=repacked)
        want = qr.awq_linear(x.double(), qweight, qzeros, scales.double(), group)
        err = float((got.double() - want).norm() / want.norm())
        assert got.dtype == dtype and got.shape == (m, n) and err < 1e-3, (m, dtype, err)
    assert calls == [1, 5, 5]
    with pytest.raises(ValueError, match="needs the checkpoint's qweight"):
        quant_cuda.awq_linear(x, None, None, scales, group)
