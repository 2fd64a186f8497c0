"""Triton for FP8 weights (float8_e4m3fn ``[N, K]``, one float32 scale per output row): the activations'
per-token quantization for ``torch._scaled_mm``, and a small-M product that never quantizes them.

- `quantize_per_token`: one kernel per product (absmax of each row, its scale, the e4m3 cast) where torch
  ops took six (abs, amax, clamp, divide, clamp, cast), each a pass over the activations.  The same
  arithmetic as kernels/quant_reference.py's (IEEE division, round to nearest even), so its bytes equal
  torch's.
- `w8a16_linear`: ``x @ (w x scale)^T`` for a decode step's few rows.  Bound by reading the weight once, so
  it converts e4m3 to x's dtype in registers (exact: e4m3 fits in bf16 and fp16) and multiplies in 16 bits
  or float32, with the row scale applied once at the end: no activation quantization (one kernel, and a
  more exact product than W8A8).  Two inner loops: CUDA-core FMAs for one to a few rows (no tensor-core
  operand layout to build), and a tensor-core dot with the weight tile as the left operand ("swap AB": the
  output columns fill the MMA's 64-row side, the few tokens its narrow side) for up to 16 and more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import e4m3_bits
from kernels.operands import rows
from kernels.splitk import cdiv, reduce_splits, split_geometry, split_k

FP8 = torch.float8_e4m3fn
FP8_MAX = tl.constexpr(448.0)  # a Triton kernel reads only constexpr globals
_ONE_PASS_MAX = 16384  # a row this long is held in registers (one read); longer rows are read twice


@triton.jit(do_not_specialize=["K", "stride_xm"])
def _quant_rows_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, NATIVE: tl.constexpr
):
    """One row: scale = max|x| / 448 (at least 1e-12 / 448), q = e4m3(x / scale)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * K
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            mask = k0 + offs < K
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)))
        amax = tl.max(amax, 0)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), FP8_MAX)
    tl.store(s_ptr + row, scale)
    if ONE_PASS:
        y = tl.math.div_rn(x, scale)
        if NATIVE:  # cvt.rn.satfinite: clamps to +-448, rounds to nearest even, as torch's cast
            bits = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:  # the interpreter's own cast rounds wrongly (kernels/fp8.py)
            bits = e4m3_bits(y)
        tl.store(q_row + offs, bits, mask=mask)
    else:
        for k0 in range(0, K, BLOCK):
            mask = k0 + offs < K
            y = tl.math.div_rn(tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32), scale)
            if NATIVE:
                bits = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            else:
                bits = e4m3_bits(y)
            tl.store(q_row + k0 + offs, bits, mask=mask)


@triton.jit(do_not_specialize=["M", "K", "stride_xm"])
def _quant_tile_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
    NATIVE: tl.constexpr,
):
    """ROWS rows per program, the same arithmetic as _quant_rows_kernel.  Not ONE_PASS: the rows are read in
    chunks of BLOCK twice (the absmax, then the cast; the second read comes from L2), so no row is held whole."""
    rows_ = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows_ < M
    x_rows = x_ptr + rows_.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + rows_.to(tl.int64)[:, None] * K
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = row_mask[:, None] & (offs < K)[None, :]
        x = tl.load(x_rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 1)
    else:
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            mask = row_mask[:, None] & (k0 + offs < K)[None, :]
            acc = tl.maximum(acc, tl.abs(tl.load(x_rows + k0 + offs[None, :], mask=mask, other=0.0).to(tl.float32)))
        amax = tl.max(acc, 1)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), FP8_MAX)
    tl.store(s_ptr + rows_, scale, mask=row_mask)
    if ONE_PASS:
        y = tl.math.div_rn(x, scale[:, None])
        if NATIVE:
            bits = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            bits = e4m3_bits(y)
        tl.store(q_rows + offs[None, :], bits, mask=mask)
    else:
        for k0 in range(0, K, BLOCK):
            mask = row_mask[:, None] & (k0 + offs < K)[None, :]
            x = tl.load(x_rows + k0 + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            y = tl.math.div_rn(x, scale[:, None])
            if NATIVE:
                bits = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            else:
                bits = e4m3_bits(y)
            tl.store(q_rows + k0 + offs[None, :], bits, mask=mask)


# "tile" (_quant_tile_kernel with quant_config's tiles) or "row" (_quant_rows_kernel: one row per program, the
# whole row held; the earlier kernel), read at each call (benchmarks/quant_profile.py's baseline arm).
QUANT_KERNEL = "tile"


def quant_config(m: int, k: int) -> dict:
    """_quant_tile_kernel's tiles by shape, the fastest of benchmarks/quant_profile.py --micro --sweeps on an H200
    at K = 4096 and 14336, M = 256 and 8192 (docs/decisions/quant-paths.md): a row up to 4,096 wide in one pass with
    8 warps; a 14,336-wide row in two passes over 2,048-element chunks, two rows per program, from 1,024 rows, and
    held whole with 16 warps below."""
    width = triton.next_power_of_2(max(k, 16))
    if width <= 4096:
        return dict(ROWS=1, BLOCK=width, num_warps=8 if width >= 2048 else 4)
    if m < 1024 and width <= _ONE_PASS_MAX:
        return dict(ROWS=1, BLOCK=width, num_warps=16)
    return dict(ROWS=2, BLOCK=2048, num_warps=8)


def quantize_per_token(
    x: torch.Tensor, block: int | None = None, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x ``[M, K]`` as e4m3 row by row, float32 scales ``[M, 1]``): kernels/quant_reference.py's
    quantize_per_token in one kernel.  `block`: the row kernel's chunk (default: the whole row up to 16,384
    elements; given, the row kernel runs); `config`: the tile kernel's ROWS / BLOCK / num_warps (default:
    quant_config's)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_per_token takes a 2-D tensor, not {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if not (m and k):
        return q, s
    native = x.device.type == "cuda"
    if block is not None or (config is None and QUANT_KERNEL == "row"):
        if block is None:
            block = triton.next_power_of_2(min(k, _ONE_PASS_MAX))
        _quant_rows_kernel[(m,)](
            x,
            q.view(torch.uint8),
            s,
            k,
            x.stride(0),
            BLOCK=block,
            ONE_PASS=block >= k,
            NATIVE=native,
            num_warps=min(16, max(4, block // 1024)),
        )
        return q, s
    cfg = dict(quant_config(m, k), **(config or {}))
    rows_, blk = cfg.pop("ROWS"), cfg.pop("BLOCK")
    _quant_tile_kernel[(triton.cdiv(m, rows_),)](
        x, q.view(torch.uint8), s, m, k, x.stride(0), ROWS=rows_, BLOCK=blk, ONE_PASS=blk >= k, NATIVE=native, **cfg
    )
    return q, s


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_om", "stride_os", "k_per_split"])
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_os,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """``out[m, n] = ws[n] * sum_k x[m, k] w[n, k]`` over this program's split of K (float32 partials when
    K is split, the output dtype otherwise)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
        else:
            mask_k = offs_k < k_end
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if USE_DOT:  # [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M]: the weight is the wide operand
            if EVEN_K:
                xt = tl.load(x_rows[None, :] + offs_k[:, None], mask=mask_m[None, :], other=0.0)
            else:
                xt = tl.load(x_rows[None, :] + offs_k[:, None], mask=mask_m[None, :] & mask_k[:, None], other=0.0)
            if DOT_DTYPE == tl.float32:  # float32 activations: a float32 product, not TF32's (tl.dot's default)
                acc = tl.dot(w.to(DOT_DTYPE), xt.to(DOT_DTYPE), acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(DOT_DTYPE), xt.to(DOT_DTYPE), acc)
        elif BLOCK_M == 1:
            if EVEN_K:  # a program per row: the row exists
                x = tl.load(x_rows + offs_k)
            else:
                x = tl.load(x_rows + offs_k, mask=mask_k, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        else:
            if EVEN_K:
                x = tl.load(x_rows[:, None] + offs_k[None, :], mask=mask_m[:, None], other=0.0)
            else:
                x = tl.load(x_rows[:, None] + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    ws = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    out = out_ptr + split * stride_os
    if USE_DOT:
        y = acc * ws[:, None]
        tl.store(
            out + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None],
            y.to(out_ptr.dtype.element_ty),
            mask=mask_n[:, None] & mask_m[None, :],
        )
    elif BLOCK_M == 1:
        y = tl.sum(acc, 1) * ws
        tl.store(out + pid_m.to(tl.int64) * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        y = tl.sum(acc, 2) * ws[None, :]
        tl.store(
            out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
            y.to(out_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_n[None, :],
        )


def dot_dtype(dtype: torch.dtype, device: torch.device) -> tl.dtype:
    """The tensor-core operand type for activations of `dtype`.  Triton's CPU interpreter gets bfloat16 dots
    wrong (errors of 1e10 on N(0, 1) data, triton 3.9), so there a bfloat16 product is checked in float32
    (e4m3 and bfloat16 values are exact in both).  A float32 dot is IEEE float32 in _w8a16_kernel: on a GPU
    tl.dot's default for float32 operands is TF32 (10-bit mantissas: a relative error near 2e-4 where float32's is
    1e-7), which the interpreter never applies."""
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and device.type == "cuda":
        return tl.bfloat16
    return tl.float32


def w8a16_config(m: int, use_dot: bool) -> dict:
    """Default tiles by row count (the device run's kernel sweep checks them: benchmarks/quant_kernels.py)."""
    if use_dot:  # the converted weight tile lives in registers: more rows take a shorter K step (no spills)
        if m <= 16:
            return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    block_m = triton.next_power_of_2(max(m, 1))
    return dict(BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=max(64, 256 // block_m), num_warps=4, num_stages=3)


def w8a16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    use_dot: bool | None = None,
    config: dict | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """``x @ (weight x weight_scale[:, None])^T`` for x ``[..., K]`` (16- or 32-bit), weight e4m3 ``[N, K]``,
    weight_scale float32 ``[N]``; ``[..., N]`` in x's dtype.  `use_dot` (default: from 4 rows) picks the
    tensor-core loop; `splits` the K splits (default: about two programs per SM)."""
    shape = x.shape
    x2 = rows(x)
    m, k = x2.shape
    n = weight.shape[0]
    if weight.shape != (n, k) or weight_scale.shape != (n,):
        raise ValueError(f"fp8 weight {tuple(weight.shape)} / scale {tuple(weight_scale.shape)} do not fit x [*, {k}]")
    if use_dot is None:
        use_dot = m > 2
    cfg = dict(w8a16_config(m, use_dot), **(config or {}))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    if not use_dot and bm == 1:
        m_programs = m  # one row per program: each row reads the weight (through L2 after the first)
    else:
        m_programs = cdiv(m, bm)
    n_tiles = cdiv(n, bn)
    if splits is None:
        splits = split_k(k, bk, n_tiles * m_programs, x2.device)
    splits, k_per_split = split_geometry(k, bk, splits)
    out = torch.empty(
        (splits, m, n), dtype=torch.float32 if splits > 1 else x.dtype, device=x.device
    )  # float32 partials when K is split
    if m:
        _w8a16_kernel[(n_tiles, splits, m_programs)](
            x2,
            weight,
            weight_scale,
            out,
            m,
            n,
            k,
            x2.stride(0),
            n,
            m * n,
            k_per_split,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            USE_DOT=use_dot,
            DOT_DTYPE=dot_dtype(x.dtype, x.device),
            EVEN_K=k % bk == 0 and k_per_split % bk == 0,
            **cfg,
        )
    y = reduce_splits(out, x.dtype) if splits > 1 else out[0]
    return y.reshape(*shape[:-1], n)
