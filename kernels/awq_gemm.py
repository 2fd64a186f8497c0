"""Triton: ``x @ W`` with W in AutoAWQ's int4 GEMM layout, dequantized in registers (never in memory).

kernels/quant_reference.py has the layout.  One program computes a ``BLOCK_M x BLOCK_N`` tile of
the output over a range of K: for every ``BLOCK_K`` rows it loads the packed int32 words of its
columns (each word feeds the eight columns it packs: the loads of one word coalesce), shifts
each column's nibble out (column ``j`` of a word sits at nibble ``(j // 2) + 4 (j % 2)``),
subtracts the group's zero point, multiplies by the group's scale and feeds the tensor-core dot
in the activation dtype.  ``BLOCK_K`` divides the group size, so a tile needs one row of zero
points and scales.

Two shapes of work, one kernel:

- prefill (many rows): large M and N tiles, the whole K per program;
- decode (a handful of rows, the "GEMV" case): ``BLOCK_M = 16`` (the smallest dot) and split-K, so
  that a batch-1 step still spreads the weight read over every SM; the splits write float32
  partials that one sum combines.  Decode is bound by reading the packed weight: 4 bits per
  element instead of 16, the 4x lower floor the AWQ benchmark measures against.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.cache_ops import _cdiv


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_om", "k_per_split"])
def _awq_gemm_kernel(
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
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    packed_n = N // 8
    word = offs_n // 8
    col = offs_n % 8
    shift = ((col // 2) + (col % 2) * 4) * 4  # AWQ's order: nibble of column j of a word

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=mask_m[:, None],
            other=0.0,
        )
        q = tl.load(
            qweight_ptr + offs_k[:, None].to(tl.int64) * packed_n + word[None, :],
            mask=mask_n[None, :],
            other=0,
        )
        g = k0 // GROUP  # BLOCK_K divides GROUP: one group per tile
        z = tl.load(qzeros_ptr + g * packed_n + word, mask=mask_n, other=0)
        s = tl.load(scales_ptr + g * N + offs_n, mask=mask_n, other=0.0)
        nib = (q >> shift[None, :]) & 0xF
        zero = (z >> shift) & 0xF
        w = ((nib - zero[None, :]).to(tl.float32) * s.to(tl.float32)[None, :]).to(x.dtype)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)

    out = out_ptr + split * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gemm_config(m: int, group_size: int, dtype: torch.dtype) -> dict:
    """Tile sizes by row count (untuned guesses until the GPU benchmark sweeps them: see
    benchmarks/quantization.py --sweep)."""
    block_k = min(group_size, 64 if dtype == torch.float32 else 128)
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=3)
    if m <= 64:
        return dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=min(block_k, 64), num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=min(block_k, 64), num_warps=4, num_stages=3)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small, so that the tests exercise split-K


def num_splits(m_tiles: int, n_tiles: int, k: int, block_k: int, device: torch.device) -> int:
    """Split K until there are ~2 programs per SM, keeping at least 4 K-tiles per split."""
    programs = m_tiles * n_tiles
    target = 2 * _num_sms(device)
    if programs >= target:
        return 1
    return max(1, min(-(-target // programs), k // (4 * block_k)))


def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    config: dict | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """``x @ W`` for x ``[..., in]`` (float16 or float32), W in AWQ's layout; ``[..., out]`` in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = scales.shape[1]
    if qweight.shape != (k, n // 8) or qzeros.shape != (k // group_size, n // 8):
        raise ValueError(f"AWQ tensors {tuple(qweight.shape)}/{tuple(qzeros.shape)} do not fit x [*, {k}] -> {n}")
    cfg = dict(gemm_config(m, group_size, x.dtype), **(config or {}))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    if group_size % bk:
        raise ValueError(f"BLOCK_K {bk} must divide the AWQ group size {group_size}")
    m_tiles, n_tiles = _cdiv(m, bm), _cdiv(n, bn)
    if splits is None:
        splits = num_splits(m_tiles, n_tiles, k, bk, x.device)
    k_per_split = _cdiv(_cdiv(k, splits), bk) * bk
    splits = _cdiv(k, k_per_split)
    if splits == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    if m:
        _awq_gemm_kernel[(m_tiles, n_tiles, splits)](
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
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            **cfg,
        )
    if splits > 1:
        out = out.sum(0).to(x.dtype)
    return out.reshape(*shape[:-1], n)
