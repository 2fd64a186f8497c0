"""Triton: a decode step's product with FP8 weights, ``x @ (w x scale)^T`` for up to 16 rows, built to read the
e4m3 weight ``[N, K]`` once at close to copy bandwidth.

A decode GEMV does two multiply-adds per weight byte: nothing but the weight read matters, so the kernel is shaped
for bytes in flight, not for arithmetic:

- every program covers all the rows of x (at most 16), so the weight is read once whatever the batch;
- a tile is ``BLOCK_N`` weight rows by ``BLOCK_K`` contiguous bytes, 16 bytes per thread per load (one 128-bit
  load), four such loads per thread per K step, and the next step's tile is loaded before this step's arithmetic
  (a register double buffer: Triton pipelines only loads that feed a dot);
- out-of-range weight rows are clamped to the last row instead of masked, so the loop's loads carry no mask
  unless K has a remainder;
- the grid is ``BLOCK_N``-row tiles times K splits, enough programs for several per SM; the splits' float32
  partials are summed by the last split of each tile inside the kernel (kernels/splitk.py), so a call is one
  launch;
- one or two rows multiply on the CUDA cores (e4m3 -> float32, a multiply-add; each thread sums its own 16
  products, the row sum across threads once at the end; three or four rows would spill); three to sixteen rows
  take a tensor-core dot with the weight tile as the wide operand ("swap AB": x's rows are the narrow side),
  converted to x's 16-bit type, which is exact for e4m3;
- the scale is one float32 per output row (or one for the tensor, PER_TENSOR), applied once to the sum.

kernels/fp8_linear.py's W8A16 kernel computes the same product with the old tiles (a per-row program at M > 1,
a separate sum kernel); benchmarks/quant_kernels.py times both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_linear import dot_dtype
from kernels.operands import rows
from kernels.splitk import cdiv, num_sms, reduce_splits, split_geometry, store_or_finish, tickets

MAX_ROWS = 16  # the kernel holds all of x's rows in one tile
VEC = tl.constexpr(16)  # e4m3 bytes per 128-bit load: one thread's run of K
CUDA_CORE_MAX_ROWS = 2  # beyond this the CUDA cores' multiply-adds, not the weight read, would bound the kernel


@triton.jit
def _tile_product(
    w,
    x_ptr,
    offs_m,
    offs_k,
    mask_m,
    mask_k,
    stride_xm,
    acc,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    EVEN_K: tl.constexpr,
    VEC: tl.constexpr,
):
    """acc + this K step's contribution of the weight tile `w` ``[BLOCK_N, BLOCK_K]`` (e4m3)."""
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    if USE_DOT:  # [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M]; x loaded along K (contiguous), then transposed
        if EVEN_K:
            x = tl.load(x_rows[:, None] + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        else:
            x = tl.load(x_rows[:, None] + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        return tl.dot(w.to(DOT_DTYPE), tl.trans(x.to(DOT_DTYPE)), acc)
    elif BLOCK_M == 1:  # acc [BLOCK_N, BLOCK_K // VEC]: each thread's 16 products summed in registers
        if EVEN_K:
            x = tl.load(x_rows + offs_k)
        else:
            x = tl.load(x_rows + offs_k, mask=mask_k, other=0.0)
        p = w.to(tl.float32) * x.to(tl.float32)[None, :]
        return acc + tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // VEC, VEC)), 2)
    else:  # acc [BLOCK_M, BLOCK_N, BLOCK_K // VEC]
        if EVEN_K:
            x = tl.load(x_rows[:, None] + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        else:
            x = tl.load(x_rows[:, None] + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        p = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        return acc + tl.sum(tl.reshape(p, (BLOCK_M, BLOCK_N, BLOCK_K // VEC, VEC)), 3)


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_om"])
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    part_ptr,
    ticket_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr,
    IN_KERNEL: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PER_TENSOR: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """``out[m, n] = ws[n] * sum_k x[m, k] w[n, k]`` for this program's BLOCK_N rows of w over its split of K.
    EVEN_K: every split is whole BLOCK_K steps (no K mask anywhere)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    rows = tl.minimum(offs_n, N - 1)  # clamped, not masked: the loads stay unpredicated
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    # register double buffer: the tile of step i + 1 is in flight while step i multiplies
    if EVEN_K:
        w_next = tl.load(w_rows + offs_k[None, :], eviction_policy="evict_first")
    else:
        w_next = tl.load(
            w_rows + offs_k[None, :], mask=(offs_k < k_end)[None, :], other=0.0, eviction_policy="evict_first"
        )
    for k0 in range(k_start, k_end, BLOCK_K):
        w = w_next
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        nxt = offs_k + BLOCK_K
        if EVEN_K:  # the step after the last is clamped into this split (a re-read of the last tile, never used)
            k_next = tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K)
            w_next = tl.load(w_rows + (k_next + tl.arange(0, BLOCK_K))[None, :], eviction_policy="evict_first")
        else:
            w_next = tl.load(
                w_rows + nxt[None, :], mask=(nxt < k_end)[None, :], other=0.0, eviction_policy="evict_first"
            )
        acc = _tile_product(
            w,
            x_ptr,
            offs_m,
            offs_k,
            mask_m,
            mask_k,
            stride_xm,
            acc,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            USE_DOT,
            DOT_DTYPE,
            EVEN_K,
            VEC,
        )
    if USE_DOT:
        y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    elif BLOCK_M == 1:
        y = tl.reshape(tl.sum(acc, 1), (1, BLOCK_N))
    else:
        y = tl.sum(acc, 2)
    if PER_TENSOR:
        y = y * tl.load(ws_ptr)
    else:
        y = y * tl.load(ws_ptr + rows)[None, :]
    store_or_finish(y, out_ptr, part_ptr, ticket_ptr, offs_m, offs_n, M, N, stride_om, pid_n, split, SPLITS, IN_KERNEL)


def fp8_gemv_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """Tiles and K splits by a rule instead of an autotuner (a first call compiles one kernel, not a sweep):

    - BLOCK_K x BLOCK_N bytes per step are four 16-byte loads per thread (4 warps: 8 KiB), double-buffered;
    - the CUDA-core loops' float32 partial products stay at <= 64 registers a thread;
    - K is split until the tiles make about four programs per SM, keeping >= 4 steps per split.
    """
    if m <= 1:
        cfg = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=512, USE_DOT=False, num_warps=4)
    elif m <= CUDA_CORE_MAX_ROWS:
        block_m = triton.next_power_of_2(m)
        cfg = dict(BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=512, USE_DOT=False, num_warps=4)
    else:  # a 16 x 16 x 16 MMA's narrow side holds the rows; 64-row weight tiles fill a warp group
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, USE_DOT=True, num_warps=4)
    tiles = cdiv(n, cfg["BLOCK_N"])
    target = 4 * num_sms(device)
    steps = cdiv(k, cfg["BLOCK_K"])
    cfg["SPLITS"] = 1 if tiles >= target else max(1, min(cdiv(target, tiles), steps // 4))
    return cfg


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    config: dict | None = None,
    in_kernel_sum: bool = True,
) -> torch.Tensor:
    """``x @ (weight x weight_scale)^T`` for x ``[..., K]`` (bf16, fp16 or fp32) with at most MAX_ROWS rows,
    weight e4m3 ``[N, K]`` row-major, weight_scale float32 ``[N]`` (per output row) or one element (per tensor);
    ``[..., N]`` in x's dtype.  `config` overrides fp8_gemv_config's tiles (and SPLITS); `in_kernel_sum` False sums
    the splits with a second kernel instead (the A/B of the device benchmark)."""
    shape = x.shape
    x2 = rows(x)
    m, k = x2.shape
    n = weight.shape[0]
    if weight.shape != (n, k) or weight.stride() != (k, 1) or weight_scale.numel() not in (1, n):
        raise ValueError(f"fp8 weight {tuple(weight.shape)} / scale {tuple(weight_scale.shape)} do not fit x [*, {k}]")
    if m > MAX_ROWS:
        raise ValueError(f"fp8_gemv takes at most {MAX_ROWS} rows, not {m}")
    cfg = dict(fp8_gemv_config(m, n, k, x2.device), **(config or {}))
    bm, bn, bk, splits = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("SPLITS")
    use_dot = cfg.pop("USE_DOT")
    if bm < m:
        raise ValueError(f"BLOCK_M {bm} is fewer than the {m} rows")
    splits, k_per_split = split_geometry(k, bk, splits)
    tiles = cdiv(n, bn)
    ticket = tickets(x2.device, tiles) if splits > 1 and in_kernel_sum else None
    in_kernel = ticket is not None
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    if m and n:
        _fp8_gemv_kernel[(tiles, splits)](
            x2,
            weight,
            weight_scale,
            out,
            part,
            ticket if in_kernel else out,
            m,
            n,
            k,
            x2.stride(0),
            n,
            k_per_split,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            SPLITS=splits,
            IN_KERNEL=in_kernel,
            USE_DOT=use_dot,
            DOT_DTYPE=dot_dtype(x.dtype, x.device),
            PER_TENSOR=weight_scale.numel() == 1 and n != 1,
            EVEN_K=k % bk == 0,  # split_geometry's splits are whole BLOCK_K steps
            **cfg,
        )
        if splits > 1 and not in_kernel:
            out = reduce_splits(part, x.dtype)
    return out.reshape(*shape[:-1], n)
