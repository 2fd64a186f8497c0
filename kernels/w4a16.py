"""Triton: ``x @ W`` with W in AutoAWQ's int4 GEMM layout (kernels/quant_reference.py), read once and
dequantized in registers at every row count.

kernels/awq_gemm.py's paths convert each nibble with an integer-to-float instruction (a quarter-rate unit),
give each row of a decode batch its own pass over the weight, finish split-K with two more kernels, and from
48 rows write the whole weight out in 16 bits for cuBLAS.  Here:

- nibbles become floats without a conversion instruction: a 4-bit value ORed into the mantissa of a power of
  two (1024 in float16, 2^23 in float32) and reinterpreted is that power plus the value; the zero point
  gets the same treatment, so ``q - z`` is one exact subtraction;
- float16 activations: ``(q - z) x s`` in float16 is the float32 product rounded once, the same bits as the
  reference's dequantized weight;
- one program covers every row of its tile (up to BLOCK_M), so a decode batch reads each packed word once;
  one row alone can take the CUDA-core loop instead (no tensor-core operand to build);
- the same kernel is the large-M GEMM: ``BLOCK_M x BLOCK_N`` tiles whose weight tile is dequantized in the
  prologue of each K step (no bf16 copy of the weight is ever written);
- split-K partials are summed by one kernel (kernels/splitk.py).

AWQ's own layout is kept (no repacking): the weights keeper shares the checkpoint's tensors as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.awq_gemm import _unpack
from kernels.operands import awq_dims, rows
from kernels.splitk import cdiv, reduce_splits, split_geometry, split_k


@triton.jit
def _magic16(v):
    """int32 values 0..15 -> 1024 + v in float16, exactly, with bit operations only."""
    return (v | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _magic32(v):
    """int32 values 0..15 -> 2^23 + v in float32, exactly, with bit operations only."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_om", "stride_os", "k_per_split"])
def _w4a16_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_os,
    k_per_split,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    FP16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """This program's ``[BLOCK_M, BLOCK_N]`` tile over its split of K.  BLOCK_K divides GROUP, so a K step
    needs one row of zero points and scales.  Without USE_DOT, BLOCK_M is 1 (one row per program)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # the packed words of those columns
    packed_n = N // 8
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask_w = offs_w < packed_n
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    if USE_DOT:
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(
            qweight_ptr + offs_k[:, None].to(tl.int64) * packed_n + offs_w[None, :], mask=mask_w[None, :], other=0
        )
        g = k0 // GROUP
        z = tl.load(qzeros_ptr + g * packed_n + offs_w, mask=mask_w, other=0)
        s = tl.load(scales_ptr + g * N + offs_n, mask=mask_n, other=0.0)
        nib = _unpack(q, BLOCK_K, BLOCK_N)
        zero = tl.reshape(_unpack(z[None, :], 1, BLOCK_N), (BLOCK_N,))
        if USE_DOT:
            if FP16:  # exact difference, one rounding of the product: the reference's float16 weight
                w = (_magic16(nib) - _magic16(zero)[None, :]) * s.to(tl.float16)[None, :]
            else:
                w = (_magic32(nib) - _magic32(zero)[None, :]) * s.to(tl.float32)[None, :]
            if SWAP_AB:  # [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M]: the output columns fill the MMA's wide side
                xt = tl.load(x_rows[None, :] + offs_k[:, None], mask=mask_m[None, :], other=0.0)
                acc = tl.dot(tl.trans(w.to(xt.dtype)), xt, acc, input_precision=DOT_PRECISION)
            else:
                x = tl.load(x_rows[:, None] + offs_k[None, :], mask=mask_m[:, None], other=0.0)
                acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
        else:
            x = tl.load(x_rows + offs_k).to(tl.float32)  # BLOCK_M is 1: this program's row, which exists
            w32 = (_magic32(nib) - _magic32(zero)[None, :]) * s.to(tl.float32)[None, :]
            acc += x[:, None] * w32
    out = out_ptr + split * stride_os
    if USE_DOT and SWAP_AB:
        tl.store(
            out + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask_n[:, None] & mask_m[None, :],
        )
    elif USE_DOT:
        tl.store(
            out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_n[None, :],
        )
    else:
        y = tl.sum(acc, 0)
        tl.store(out + pid_m.to(tl.int64) * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask_n)


def w4a16_config(m: int, group_size: int, use_dot: bool) -> dict:
    """Default tiles by row count (the device run's kernel sweep checks them: benchmarks/quant_kernels.py).
    BLOCK_K is capped by the group size, which it must divide."""
    if not use_dot:  # one row: 256 columns are 128 bytes of packed words per K row
        return dict(BLOCK_M=1, BLOCK_N=256, BLOCK_K=min(group_size, 32), num_warps=4, num_stages=4, SWAP_AB=False)
    block_k = min(group_size, 64)
    if m <= 64:  # the weight tile on the MMA's 64-row side (a warp-group MMA; fewer rows would not fill one)
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=block_k, num_warps=4, num_stages=3, SWAP_AB=True)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, num_warps=8, num_stages=3, SWAP_AB=False)


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    use_dot: bool | None = None,
    config: dict | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """``x @ W`` for x ``[..., K]`` (float16 or float32), W in AWQ's layout; ``[..., N]`` in x's dtype.
    `use_dot` (default: from 2 rows) picks the tensor-core loop over the one-row CUDA-core loop; `splits` the
    K splits (default: about two programs per SM)."""
    shape = x.shape
    x2 = rows(x)
    m, k, n = awq_dims(x2, qweight, qzeros, scales, group_size)
    if k % group_size:
        raise ValueError(f"AWQ tensors {tuple(qweight.shape)}/{tuple(qzeros.shape)} do not fit x [*, {k}] -> {n}")
    if use_dot is None:
        use_dot = m > 1
    cfg = dict(w4a16_config(m, group_size, use_dot), **(config or {}))
    bm, bn, bk, swap = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("SWAP_AB")
    if group_size % bk or bn % 8:
        raise ValueError(f"BLOCK_K {bk} must divide the AWQ group size {group_size}, BLOCK_N {bn} be a multiple of 8")
    if not use_dot and bm != 1:
        raise ValueError("the CUDA-core loop takes one row per program (BLOCK_M 1)")
    m_tiles, n_tiles = cdiv(m, bm), cdiv(n, bn)
    if splits is None:
        splits = split_k(k, bk, m_tiles * n_tiles, x2.device)
    splits, k_per_split = split_geometry(k, bk, splits)
    out = torch.empty((splits, m, n), dtype=torch.float32 if splits > 1 else x.dtype, device=x.device)
    if m:
        _w4a16_kernel[(m_tiles, n_tiles, splits)](
            x2,
            qweight,
            qzeros,
            scales,
            out,
            m,
            n,
            k,
            x2.stride(0),
            n,
            m * n,
            k_per_split,
            GROUP=group_size,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            USE_DOT=use_dot,
            SWAP_AB=swap,
            FP16=x.dtype == torch.float16,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            **cfg,
        )
    y = reduce_splits(out, x.dtype) if splits > 1 else out[0]
    return y.reshape(*shape[:-1], n)
