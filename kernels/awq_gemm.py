"""Triton: ``x @ W`` with W in AutoAWQ's int4 GEMM layout.

kernels/quant_reference.py has the layout.  Every path loads each packed int32 word once and shifts its
eight nibbles out side by side in registers (column ``j`` of a word sits at nibble ``(j // 2) + 4 (j % 2)``);
``BLOCK_K`` divides the group size, so a tile needs one row of zero points and scales.  Three paths, by the
number of rows (measured on an H100, benchmarks/quantization.py):

- up to GEMV_MAX_ROWS (a decode step of a few sequences): one row per program on the CUDA cores, split-K,
  the group's zero point factored out of the sum.  Decode is bound by reading the packed weight (4 bits per
  element instead of 16: the 4x lower floor the AWQ benchmark measures against), and a tensor-core dot would
  pad the row to sixteen and move every unpacked tile into its operand layout;
- up to DENSE_MIN_ROWS: ``BLOCK_M x BLOCK_N`` tiles dequantized in registers feeding the tensor-core dot,
  split-K when the tiles alone would leave SMs idle (float32 partials that one sum combines);
- from DENSE_MIN_ROWS (prefill): the weight dequantized once by a Triton kernel, then cuBLAS, which runs at
  the matmul rate that a dequantize-in-registers tile does not reach.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.cache_ops import _cdiv
from kernels.operands import awq_dims, rows


@triton.jit
def _unpack(words, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``[ROWS, COLS // 8]`` packed int32 words -> ``[ROWS, COLS]`` int4 values in column order: each word is
    loaded once and its eight nibbles are shifted out side by side (column ``j`` of a word sits at nibble
    ``(j // 2) + 4 (j % 2)``, AWQ's order)."""
    j = tl.arange(0, 8)
    shift = ((j // 2) + (j % 2) * 4) * 4
    nib = (words[:, :, None] >> shift[None, None, :]) & 0xF
    return tl.reshape(nib, (ROWS, COLS))


@triton.jit
def _dequant_tile(
    q, z, s, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, OUT_DTYPE: tl.constexpr, FP16_MATH: tl.constexpr
):
    """(nibble - zero) x scale for a ``[BLOCK_K, BLOCK_N]`` tile with one group's zero points and scales.
    FP16_MATH: the product of a small integer and a float16 scale is exact before its one rounding, so
    float16 arithmetic gives the float32 result rounded to float16, in half the instructions."""
    nib = _unpack(q, BLOCK_K, BLOCK_N)
    zero = tl.reshape(_unpack(z[None, :], 1, BLOCK_N), (BLOCK_N,))
    if FP16_MATH:
        return (nib - zero[None, :]).to(tl.float16) * s.to(tl.float16)[None, :]
    return ((nib - zero[None, :]).to(tl.float32) * s.to(tl.float32)[None, :]).to(OUT_DTYPE)


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
    FP16_MATH: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # the packed words of those columns
    mask_m = offs_m < M
    mask_n = offs_n < N
    packed_n = N // 8
    mask_w = offs_w < packed_n

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
            qweight_ptr + offs_k[:, None].to(tl.int64) * packed_n + offs_w[None, :],
            mask=mask_w[None, :],
            other=0,
        )
        g = k0 // GROUP  # BLOCK_K divides GROUP: one group per tile
        z = tl.load(qzeros_ptr + g * packed_n + offs_w, mask=mask_w, other=0)
        s = tl.load(scales_ptr + g * N + offs_n, mask=mask_n, other=0.0)
        w = _dequant_tile(q, z, s, BLOCK_K, BLOCK_N, x.dtype, FP16_MATH)
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)

    out = out_ptr + split * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["stride_xm", "stride_om", "k_per_split"])
def _awq_gemv_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_om,
    stride_os,
    k_per_split,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One row of ``x @ W`` on the CUDA cores: a decode step's product reads each packed word once and
    needs no tensor-core operand layout (the tiled kernel pads one row to sixteen and moves every
    unpacked tile into the dot's layout).  Per group the zero point comes out of the sum:
    ``sum_k x_k (q_kn - z_n) s_n = s_n (sum_k x_k q_kn - z_n sum_k x_k)``."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    packed_n = N // 8
    mask_n = offs_n < N
    mask_w = offs_w < packed_n
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + offs_k).to(tl.float32)
        q = tl.load(
            qweight_ptr + offs_k[:, None].to(tl.int64) * packed_n + offs_w[None, :], mask=mask_w[None, :], other=0
        )
        g = k0 // GROUP
        z = tl.load(qzeros_ptr + g * packed_n + offs_w, mask=mask_w, other=0)
        s = tl.load(scales_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        nib = _unpack(q, BLOCK_K, BLOCK_N).to(tl.float32)
        zero = tl.reshape(_unpack(z[None, :], 1, BLOCK_N), (BLOCK_N,)).to(tl.float32)
        acc += s * (tl.sum(x[:, None] * nib, 0) - zero * tl.sum(x, 0))
    out = out_ptr + split * stride_os + row.to(tl.int64) * stride_om + offs_n
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _awq_dequant_kernel(
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    out_ptr,
    N,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP16_MATH: tl.constexpr,
):
    """The whole weight ``[K, N]`` in the activation dtype, for many-row products (a cuBLAS GEMM then
    runs at the matmul rate, which a dequantize-in-registers tile cannot match)."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    packed_n = N // 8
    mask_w = offs_w < packed_n
    mask_n = offs_n < N
    q = tl.load(qweight_ptr + offs_k[:, None].to(tl.int64) * packed_n + offs_w[None, :], mask=mask_w[None, :], other=0)
    g = (pid_k * BLOCK_K) // GROUP
    z = tl.load(qzeros_ptr + g * packed_n + offs_w, mask=mask_w, other=0)
    s = tl.load(scales_ptr + g * N + offs_n, mask=mask_n, other=0.0)
    w = _dequant_tile(q, z, s, BLOCK_K, BLOCK_N, out_ptr.dtype.element_ty, FP16_MATH)
    tl.store(
        out_ptr + offs_k[:, None].to(tl.int64) * N + offs_n[None, :],
        w.to(out_ptr.dtype.element_ty),
        mask=mask_n[None, :],
    )


# From this many rows a product dequantizes the weight once and runs cuBLAS (the GPU benchmark's
# `awq_gemm` rows time both paths: benchmarks/quantization.py).
DENSE_MIN_ROWS = 48  # H100: at 64 rows dequantize + cuBLAS won on all four shapes, at 16 none


def dequant_config(group_size: int) -> dict:
    """_awq_dequant_kernel's tile (BLOCK_K divides the group size): 32 x 256, the fastest of the tiles
    benchmarks/quant_profile.py --micro --sweeps tried on all four of the 8B's projections on an H200
    (docs/decisions/quant-paths.md)."""
    return dict(BLOCK_K=min(group_size, 32), BLOCK_N=256, num_warps=4)


def awq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    config: dict | None = None,
) -> torch.Tensor:
    """The weight ``[K, N]`` in `dtype`, unpacked by one Triton kernel (`config`: its tile, default
    dequant_config's)."""
    k, packed_n = qweight.shape
    n = packed_n * 8
    out = torch.empty((k, n), dtype=dtype, device=qweight.device)
    cfg = dict(dequant_config(group_size), **(config or {}))
    block_k, block_n = cfg.pop("BLOCK_K"), cfg.pop("BLOCK_N")
    if group_size % block_k or block_n % 8:
        raise ValueError(
            f"BLOCK_K {block_k} must divide the AWQ group size {group_size}, BLOCK_N {block_n} be a multiple of 8"
        )
    _awq_dequant_kernel[(_cdiv(k, block_k), _cdiv(n, block_n))](
        qweight,
        qzeros,
        scales,
        out,
        n,
        GROUP=group_size,
        BLOCK_K=block_k,
        BLOCK_N=block_n,
        FP16_MATH=dtype == torch.float16,
        **cfg,
    )
    return out


GEMV_MAX_ROWS = 4  # a decode batch of a few sequences


def _gemv(
    x2: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    config: dict | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    m, k = x2.shape
    n = scales.shape[1]
    cfg = dict(dict(BLOCK_N=256, BLOCK_K=min(group_size, 64), num_warps=4, num_stages=3), **(config or {}))
    bn, bk = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    if group_size % bk:
        raise ValueError(f"BLOCK_K {bk} must divide the AWQ group size {group_size}")
    n_tiles = _cdiv(n, bn)
    splits, k_per_split = _split_k(k, bk, num_splits(m, n_tiles, k, bk, x2.device) if splits is None else splits)
    out = _partials(splits, m, n, x2.dtype, x2.device)
    if m:
        _awq_gemv_kernel[(n_tiles, splits, m)](
            x2,
            qweight,
            qzeros,
            scales,
            out,
            n,
            k,
            x2.stride(0),
            n,
            m * n,
            k_per_split,
            GROUP=group_size,
            BLOCK_N=bn,
            BLOCK_K=bk,
            **cfg,
        )
    return _combined(out, x2.dtype)


def _split_k(k: int, block_k: int, splits: int) -> tuple[int, int]:
    """(splits, rows of K per split): whole BLOCK_K tiles per split, and no split left empty."""
    k_per_split = _cdiv(_cdiv(k, splits), block_k) * block_k
    return _cdiv(k, k_per_split), k_per_split


def _partials(splits: int, m: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[splits, m, n]``: float32 partial sums when K is split, else the result itself in `dtype`."""
    return torch.empty((splits, m, n), dtype=torch.float32 if splits > 1 else dtype, device=device)


def _combined(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return out.sum(0).to(dtype) if out.shape[0] > 1 else out[0]


def gemm_config(m: int, group_size: int, dtype: torch.dtype) -> dict:
    """Tile sizes by row count.  Decode rows from the H100 sweep (benchmarks/quantization.py --sweep, the 8B's
    four projections at M = 1 and 16): 256-column tiles of 64 rows with 8 warps and split-K were best or
    within 10 % of best on every shape; from DENSE_MIN_ROWS rows the weight is dequantized for cuBLAS."""
    block_k = min(group_size, 64)
    if m <= 16:
        return dict(
            BLOCK_M=16, BLOCK_N=256 if dtype != torch.float32 else 64, BLOCK_K=block_k, num_warps=8, num_stages=3
        )
    if m <= 64:
        return dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=block_k, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=block_k, num_warps=4, num_stages=3)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small, so that the tests exercise split-K


def num_splits(m_tiles: int, n_tiles: int, k: int, block_k: int, device: torch.device) -> int:
    """Split K until there are ~6 programs per SM (a decode GEMV needs many loads in flight), keeping at least
    4 K-tiles per split."""
    programs = m_tiles * n_tiles
    target = 6 * _num_sms(device)
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
    dense: bool | None = None,
    gemv: bool | None = None,
    gemv_config: dict | None = None,
) -> torch.Tensor:
    """``x @ W`` for x ``[..., in]`` (float16 or float32), W in AWQ's layout; ``[..., out]`` in x's dtype.
    `dense`: dequantize W once and multiply densely (default: from DENSE_MIN_ROWS rows on a GPU); `gemv`:
    one row per program on the CUDA cores (default: up to GEMV_MAX_ROWS rows in 16 bits)."""
    shape = x.shape
    x2 = rows(x)
    m, k, n = awq_dims(x2, qweight, qzeros, scales, group_size)
    fp16_math = x.dtype == torch.float16
    if dense is None:
        dense = m >= DENSE_MIN_ROWS and x.device.type == "cuda" and config is None
    if dense:
        return (x2 @ awq_dequantize(qweight, qzeros, scales, group_size, x.dtype)).reshape(*shape[:-1], n)
    if gemv is None:
        gemv = m <= GEMV_MAX_ROWS and x.dtype != torch.float32 and config is None
    if gemv:
        return _gemv(x2, qweight, qzeros, scales, group_size, config=gemv_config, splits=splits).reshape(*shape[:-1], n)
    cfg = dict(gemm_config(m, group_size, x.dtype), **(config or {}))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    if group_size % bk:
        raise ValueError(f"BLOCK_K {bk} must divide the AWQ group size {group_size}")
    m_tiles, n_tiles = _cdiv(m, bm), _cdiv(n, bn)
    splits, k_per_split = _split_k(k, bk, num_splits(m_tiles, n_tiles, k, bk, x.device) if splits is None else splits)
    out = _partials(splits, m, n, x.dtype, x.device)
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
            FP16_MATH=fp16_math,
            **cfg,
        )
    return _combined(out, x.dtype).reshape(*shape[:-1], n)
