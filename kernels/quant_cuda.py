"""Quantized matmuls on CUDA: FP8 through ``torch._scaled_mm``, AWQ through the Triton kernel.

The same functions as kernels/quant_reference.py (which is the oracle for both).

FP8: activations are quantized per token (a row-wise scale, max|row| / 448) and multiplied with the
e4m3 weight by ``torch._scaled_mm`` with row-wise scales on both sides (the activation's per row,
the weight's per output channel), accumulating in float32 on the FP8 tensor cores (compute
capability 8.9+; the engine refuses FP8 elsewhere).  Row-wise scaling produces bfloat16 only (torch
2.6-2.9), so a float16 or float32 model converts the output back.
"""

from __future__ import annotations

import torch

from kernels.awq_gemm import awq_gemm
from kernels.quant_reference import quantize_per_token


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight x weight_scale)^T`` with x quantized per token; weight ``[out, in]`` e4m3 row-major
    (so ``weight.t()`` is the column-major operand ``_scaled_mm`` wants)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, xs = quantize_per_token(x2)
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16)
    if isinstance(y, tuple):  # torch < 2.5 returned (out, amax)
        y = y[0]
    return y.to(x.dtype).reshape(*shape[:-1], weight.shape[0])


def awq_linear(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    return awq_gemm(x, qweight, qzeros, scales, group_size)
