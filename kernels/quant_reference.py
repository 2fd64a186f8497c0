"""Plain-torch quantized matmuls: the CPU path and the oracle for the GPU kernels.

AWQ (AutoAWQ's GEMM layout, checked against awq/modules/linear/gemm.py and
awq/utils/packing_utils.py of casper-hansen/AutoAWQ): a linear layer ``y = x @ W`` with ``W``
``[in, out]`` is stored as

- ``qweight`` int32 ``[in, out / 8]``: eight 4-bit values per int32; nibble ``i`` (bits ``4i..4i+3``)
  of packed column ``c`` holds output column ``8c + AWQ_ORDER[i]``;
- ``qzeros`` int32 ``[in / group, out / 8]``: the groups' zero points, packed the same way;
- ``scales`` float16 ``[in / group, out]``;

and ``W[k, n] = (q[k, n] - z[k // group, n]) * s[k // group, n]``.  The order interleaves even and
odd columns so that AutoAWQ's CUDA kernel can unpack two fp16 values per shift.

FP8 weights: ``weight`` float8_e4m3fn ``[out, in]`` and ``weight_scale`` float32 ``[out]``
(per output channel).  A product of up to FP8_W8A16_MAX_ROWS rows (a decode step) keeps its activations in
their own dtype, ``y = x @ (wq * sw)^T``, as the GPU's W8A16 kernel computes it; a larger one quantizes them per
token (row), as ``torch._scaled_mm`` with row-wise scales computes on the GPU: ``y = (xq * sx) @ (wq * sw)^T``.
Both accumulate in float32.  The CPU path quantizes the activations at every row count, as a checkpoint's
dynamic per-token recipe (compressed-tensors' FP8_DYNAMIC) says; the GPU's decode kernel (kernels/fp8_gemv.py)
keeps them in 16 bits at up to kernels/quant_cuda.py's FP8_GEMV_MAX_ROWS rows, a more precise product that reads
the weight once (vLLM's W8A16 path does the same on GPUs without FP8), so its oracle there is the unquantized
product (`keep_activations`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed int32 holds column 8c + AWQ_ORDER[i]
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(j) for j in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Up to this many rows an FP8 product leaves its activations unquantized (the GPU's W8A16 kernel,
# kernels/fp8_linear.py).  None: on an H100 the FP8 tensor cores with per-token activations were the fastest at
# every row count, M = 1 included (kernels/quant_cuda.py's docstring has the figures).
FP8_W8A16_MAX_ROWS = 0


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` in AWQ's order -> int32 ``[R, 8C]`` values 0..15 in column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed[..., None] >> shifts) & 0xF  # [R, C, 8]: nibble i
    order = torch.tensor(AWQ_NIBBLE_OF_COLUMN, device=packed.device)
    return nibbles.index_select(-1, order).reshape(packed.shape[0], -1)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int ``[R, 8C]`` values 0..15 in column order -> int32 ``[R, C]`` in AWQ's order."""
    rows, cols = values.shape
    if cols % 8:
        raise ValueError(f"AWQ packs 8 columns per int32; {cols} columns is not a multiple of 8")
    v = values.to(torch.int64).reshape(rows, cols // 8, 8)
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64, device=values.device)
    for nibble, column in enumerate(AWQ_ORDER):
        packed |= (v[..., column] & 0xF) << (4 * nibble)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the bits, as int32


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """``W`` ``[in, out]`` float32: ``(q - z) * s`` (exact in float32)."""
    q = unpack_int4(qweight)
    z = unpack_int4(qzeros).repeat_interleave(group_size, dim=0)
    s = scales.float().repeat_interleave(group_size, dim=0)
    return (q - z).float() * s


def awq_linear(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x @ W`` (no bias) for x ``[..., in]``, dequantizing W to x's dtype on every call (the CPU path
    trades time for memory: nothing larger than the packed weight is kept)."""
    w = awq_dequantize(qweight, qzeros, scales, group_size).to(x.dtype)
    return x @ w


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / s rounded to e4m3, s float32 ``[rows, 1]``) with s = max|row| / 448: each row uses the whole range."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    # a tensor divisor: CUDA divides by a Python scalar as a multiplication by its reciprocal, one ulp off the
    # correctly rounded quotient that kernels/fp8_linear.py's kernel (and the CPU) computes
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight ``[out, in]`` as e4m3 with one float32 scale per output row (max|row| / 448)."""
    q, scale = quantize_per_token(w)
    return q, scale.squeeze(-1)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, keep_activations: bool | None = None
) -> torch.Tensor:
    """``x @ W^T`` (no bias) with W = weight x weight_scale, in float32; x quantized per token when it has
    more than FP8_W8A16_MAX_ROWS rows, or as `keep_activations` says (the oracle of a GPU path that decides
    otherwise: kernels/quant_cuda.py's fp8_keeps_activations)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    w = weight.float() * weight_scale.float()[:, None]
    if keep_activations is None:
        keep_activations = x2.shape[0] <= FP8_W8A16_MAX_ROWS
    if keep_activations:
        y = F.linear(x2.float(), w)
    else:
        xq, xs = quantize_per_token(x2)
        y = F.linear(xq.float() * xs, w)
    return y.to(x.dtype).reshape(*shape[:-1], weight.shape[0])
