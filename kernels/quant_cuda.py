"""Quantized matmuls on CUDA, each by the kernel that suits its row count (`fp8_path`, `awq_path`).

The same functions as kernels/quant_reference.py (which is the oracle for all of them).

FP8 weights (e4m3 ``[N, K]``, one float32 scale per output channel):

- up to FP8_GEMV_MAX_ROWS rows (decode): kernels/fp8_gemv.py, which reads the weight once and leaves the
  activations in 16 bits (`fp8_keeps_activations`; the CPU path quantizes them at every row count, as the
  checkpoint's dynamic recipe says: kernels/quant_reference.py);
- up to FP8_W8A16_MAX_ROWS rows (the boundary lives in kernels/quant_reference.py; 0 by default): kernels/
  fp8_linear.py's W8A16 product, the same product by older tiles (CUDA-core loop up to FP8_CUDA_CORE_MAX_ROWS,
  else tensor cores);
- above: the activations quantized per token by one Triton kernel, then ``torch._scaled_mm`` on the FP8
  tensor cores with row-wise scales on both sides (the activation's per row, the weight's per column) applied
  in the GEMM's epilogue.  Row-wise scaling is probed once per device and output dtype: where this torch or
  GPU refuses it (bf16 output only on torch's CUTLASS path; none before compute capability 9.0 on older
  builds), the product runs with unit scales into float32 and both scales are applied after it.

AWQ int4 (AutoAWQ's GEMM layout): kernels/awq_gemm.py's GEMV up to AWQ_GEMV_MAX_ROWS rows, kernels/w4a16.py's
in-register dequantization below AWQ_DENSE_MIN_ROWS (its CUDA-core loop up to AWQ_CUDA_CORE_MAX_ROWS rows), and
from there the weight dequantized once for cuBLAS.  A layer whose weight was repacked at load for kernels/w4a16_tc.py
(the engine's GPU layers, which then drop the checkpoint's layout) takes that tensor-core GEMM below
AWQ_TC_DENSE_MIN_ROWS rows (and, for a wide layer, from AWQ_TC_WIDE_MIN_ROWS to AWQ_TC_WIDE_MAX_ROWS) and, elsewhere,
the repacked weight dequantized once for cuBLAS.

The boundaries are the fastest path per row count that the device benchmark measured at the 8B's projections
(docs/decisions/quant-paths.md; tests/kernels/test_quant_dispatch.py holds the defaults to the committed table).

PAGEKEEPER_QUANT_KERNELS=legacy (read at import) runs the previous paths instead (torch-op quantization and
``_scaled_mm`` at every size; kernels/awq_gemm.py), for A/B runs of the device benchmark.  PAGEKEEPER_QUANT_KERNELS=
gemv runs the fast set with the bandwidth-shaped decode kernels in front up to FP8_GEMV_ROWS_WHEN_ON and
AWQ_GEMV2_ROWS_WHEN_ON rows (the fast set uses them only where the device table measured them fastest).
"""

from __future__ import annotations

import os

import torch

from kernels import fp8_linear as f8
from kernels import quant_reference as qr
from kernels.awq_gemm import awq_gemm
from kernels.awq_gemv import awq_gemv
from kernels.fp8_gemv import fp8_gemv
from kernels.w4a16 import w4a16_linear
from kernels.w4a16_tc import tc_dequantize, w4a16_tc

# Row-count boundaries between paths (benchmarks/quant_kernels.py times every path at the 8B's shapes and
# M = 1, 8, 32, 256, 4096; its `rule` rows name the fastest per M).
FP8_CUDA_CORE_MAX_ROWS = 1
AWQ_GEMV_MAX_ROWS = 1
AWQ_CUDA_CORE_MAX_ROWS = 0
AWQ_DENSE_MIN_ROWS = 96
# kernels/w4a16_tc.py's tensor-core GEMM on the load-time repacked weight below AWQ_TC_DENSE_MIN_ROWS rows, where a
# layer has the repacked tensors (engine/model/quant/awq.py makes them on the GPU); the paths above are for layers
# that keep the checkpoint's layout (the CPU, PAGEKEEPER_QUANT_KERNELS=legacy, K not a multiple of 128).
AWQ_TC_DENSE_MIN_ROWS = 129
# ... and also from AWQ_TC_WIDE_MIN_ROWS to AWQ_TC_WIDE_MAX_ROWS rows for a layer at least AWQ_TC_WIDE_MIN_N columns
# wide: there its 128 x 128 tiles (two of rows) fill the GPU without K splits and beat writing the dequantized
# weight (the 8B's gate_up, 28,672 columns, one H200: 0.155 ms against 0.171 at 256 rows, 0.156 against 0.162 at
# 224; 0.158 against 0.155 at 208, 0.160 against 0.153 at 192), while the narrow projections (4,096-6,144 columns,
# split along K) lose at every row count from 129 (docs/decisions/quant-paths.md, the sweep by rows and columns).
AWQ_TC_WIDE_MIN_ROWS = 224
AWQ_TC_WIDE_MAX_ROWS = 256
AWQ_TC_WIDE_MIN_N = 16384
# The decode kernels of kernels/fp8_gemv.py and kernels/awq_gemv.py, at the row counts where the device's decode
# table measured them fastest (docs/decisions/quant-paths.md: fp8_gemv at 1-16 rows, _scaled_mm from 32); the
# "gemv" kernel set turns them on up to the kernels' own limits.
FP8_GEMV_MAX_ROWS = 16
AWQ_GEMV2_MAX_ROWS = 2
FP8_GEMV_ROWS_WHEN_ON = 16
AWQ_GEMV2_ROWS_WHEN_ON = 2

KERNEL_SETS = ("fast", "legacy", "gemv")


def _kernel_set() -> str:
    value = os.environ.get("PAGEKEEPER_QUANT_KERNELS", "fast")
    if value not in KERNEL_SETS:
        raise ValueError(f"PAGEKEEPER_QUANT_KERNELS={value!r}: expected one of {', '.join(KERNEL_SETS)}")
    return value


KERNELS = _kernel_set()
if KERNELS == "gemv":
    FP8_GEMV_MAX_ROWS, AWQ_GEMV2_MAX_ROWS = FP8_GEMV_ROWS_WHEN_ON, AWQ_GEMV2_ROWS_WHEN_ON


def fp8_path(m: int) -> str:
    """Which FP8 kernel a product of `m` rows takes: "gemv", "w8a16-cuda-core", "w8a16-dot" or "scaled-mm"."""
    if KERNELS != "legacy" and 0 < m <= FP8_GEMV_MAX_ROWS:
        return "gemv"
    if KERNELS == "legacy" or m > qr.FP8_W8A16_MAX_ROWS:
        return "scaled-mm"
    return "w8a16-cuda-core" if m <= FP8_CUDA_CORE_MAX_ROWS else "w8a16-dot"


def fp8_keeps_activations(m: int) -> bool:
    """Whether the path of a product of `m` rows leaves the activations in 16 bits (the decode kernels) rather than
    quantizing them per token: the reference product its output is checked against (quant_reference.fp8_linear's
    `keep_activations`)."""
    return fp8_path(m) != "scaled-mm"


def awq_path(m: int, repacked: bool = True, n: int = 0) -> str:
    """Which AWQ kernel a product of `m` rows takes: "gemv2", "gemv", "cuda-core", "dot", "tc", "dequantize-cublas"
    or "legacy".  `repacked`: the layer keeps kernels/w4a16_tc.py's layout instead of the checkpoint's (then every
    product reads that layout: "tc" below AWQ_TC_DENSE_MIN_ROWS and, for a layer of `n` >= AWQ_TC_WIDE_MIN_N output
    columns, from AWQ_TC_WIDE_MIN_ROWS to AWQ_TC_WIDE_MAX_ROWS; "dequantize-cublas" elsewhere)."""
    if KERNELS == "legacy":
        return "legacy"
    if repacked:
        wide = n >= AWQ_TC_WIDE_MIN_N and AWQ_TC_WIDE_MIN_ROWS <= m <= AWQ_TC_WIDE_MAX_ROWS
        return "tc" if m < AWQ_TC_DENSE_MIN_ROWS or wide else "dequantize-cublas"
    if 0 < m <= AWQ_GEMV2_MAX_ROWS:
        return "gemv2"
    if m >= AWQ_DENSE_MIN_ROWS:
        return "dequantize-cublas"
    if m <= AWQ_GEMV_MAX_ROWS:
        return "gemv"
    return "cuda-core" if m <= AWQ_CUDA_CORE_MAX_ROWS else "dot"


# -- FP8 -----------------------------------------------------------------------------------------------

# FP8 products whose K is at most this use _scaled_mm's fast accumulation (the tensor cores' own accumulator, not
# promoted to float32 every few K steps): faster at K = 4096 on one H200 and no slower in error on random data
# (benchmarks/quant_profile.py --micro; docs/decisions/quant-paths.md), slower at K = 14336 (down_proj), where
# the longer sum would also lose more.  0 turns it off (quant_profile's baseline arm).
FP8_FAST_ACCUM_MAX_K = 4096

_ROWWISE: dict[tuple[torch.device, torch.dtype], torch.dtype | None] = {}
_ONE: dict[torch.device, torch.Tensor] = {}


def _rowwise_out_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The output dtype row-wise `_scaled_mm` gives for activations of `dtype` on `device` (x's own when
    allowed, else bfloat16), or None where row-wise scaling is refused.  Probed once on a 16 x 16 product."""
    key = (device, dtype)
    if key not in _ROWWISE:
        a = torch.zeros(16, 16, device=device, dtype=qr.FP8)
        b = torch.zeros(16, 16, device=device, dtype=qr.FP8).t()
        sa = torch.ones(16, 1, device=device, dtype=torch.float32)
        sb = torch.ones(1, 16, device=device, dtype=torch.float32)
        _ROWWISE[key] = None
        for out in dict.fromkeys((dtype, torch.bfloat16)):
            try:
                torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out)
            except (RuntimeError, ValueError):
                continue
            _ROWWISE[key] = out
            break
    return _ROWWISE[key]


def scaled_mm(
    xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``(xq x xs) @ (weight x weight_scale)^T`` in `dtype` on the FP8 tensor cores: xq e4m3 ``[M, K]`` with
    xs ``[M, 1]``, weight e4m3 ``[N, K]`` row-major (so ``weight.t()`` is the column-major operand)."""
    out = _rowwise_out_dtype(xq.device, dtype)
    fast = xq.shape[1] <= FP8_FAST_ACCUM_MAX_K
    if out is not None:
        y = torch._scaled_mm(
            xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1), out_dtype=out, use_fast_accum=fast
        )
    else:  # per-tensor (unit) scales, both row-wise scales applied to the float32 product
        one = _ONE.get(xq.device)
        if one is None:
            one = _ONE[xq.device] = torch.ones((), device=xq.device, dtype=torch.float32)
        y = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
        y = y * xs * weight_scale.view(1, -1)
    if isinstance(y, tuple):  # torch < 2.5 returned (out, amax)
        y = y[0]
    return y.to(dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight x weight_scale)^T`` by the path `fp8_path` names for x's row count."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    path = fp8_path(x2.shape[0])
    if path == "gemv":
        return fp8_gemv(x2, weight, weight_scale).reshape(*shape[:-1], weight.shape[0])
    if path != "scaled-mm":
        return f8.w8a16_linear(x2, weight, weight_scale, use_dot=path == "w8a16-dot").reshape(
            *shape[:-1], weight.shape[0]
        )
    xq, xs = qr.quantize_per_token(x2) if KERNELS == "legacy" else f8.quantize_per_token(x2)
    return scaled_mm(xq, xs, weight, weight_scale, x.dtype).reshape(*shape[:-1], weight.shape[0])


# -- AWQ -----------------------------------------------------------------------------------------------


def awq_linear(
    x: torch.Tensor,
    qweight: torch.Tensor | None,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    group_size: int,
    repacked: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x @ W`` by the path `awq_path` names for x's row count.  `repacked`: the layer's (packed, zf) from
    kernels/w4a16_tc.py's `awq_repack`, which replace the checkpoint's qweight and qzeros (None then)."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    path = awq_path(m, repacked is not None, scales.shape[-1])
    if repacked is not None:
        packed, zf = repacked
        if path == "tc":
            return w4a16_tc(x, packed, zf, scales, group_size)
        w = tc_dequantize(packed, zf, scales, group_size, x.dtype)
        return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[1])
    if qweight is None or qzeros is None:
        raise ValueError("an AWQ layer without its repacked weight needs the checkpoint's qweight and qzeros")
    if path == "gemv2":
        return awq_gemv(x, qweight, qzeros, scales, group_size)
    if path in ("legacy", "gemv"):  # kernels/awq_gemm.py: its GEMV at a few rows (and its own choice above)
        return awq_gemm(x, qweight, qzeros, scales, group_size)
    if path == "dequantize-cublas":
        return awq_gemm(x, qweight, qzeros, scales, group_size, dense=True)
    return w4a16_linear(x, qweight, qzeros, scales, group_size, use_dot=path == "dot")
