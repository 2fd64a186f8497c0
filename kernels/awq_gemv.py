"""Triton: a decode step's product with AWQ int4 weights (AutoAWQ's GEMM layout, kernels/quant_reference.py) for
one or a few rows, on the CUDA cores, built so that dequantizing does not bound a kernel that should be bound by
reading 4 bits per weight.

At copy bandwidth an H100 SM receives about 13 weight bytes, 26 int4 weights, per clock; at about 4 instructions
a weight (shift, mask, integer-to-float conversion, subtract, multiply-add) the SM's 128 lanes would be the limit.
Here the conversion is one bit operation and the zero point's subtraction is exact:

- a nibble masked in place (``word & (0xF << 4i)``, no shift: the upper four nibbles come from one shift of the
  word by 16) and ORed into the mantissa of 2^23 is the float ``2^23 + q x 16^i`` (one LOP3); the group's zero
  point gets the same treatment, so one subtraction gives ``(q - z) x 16^i`` exactly, and the power of 16 is
  folded into the column's scale;
- eight accumulators, one per column of a word (the nibble's mask and power of 16 are then immediates); each K
  step's products are summed per column, times that column's scale (of the step's group: BLOCK_K divides the
  group), so only the sum ever meets a scale;
- AWQ's layout is read as it is: a K row's packed words are contiguous, 16 bytes (32 weights) per thread per load,
  eight loads a thread per step, the next step's tile in flight (a register double buffer) while this one sums;
- one warp a program, so that a step's sum over K never crosses warps (shuffles, no shared memory);
- words past the last column are masked (N / 8 is passed so that the mask is constant over a 16-byte load); K
  splits are whole groups, summed by the last split of each tile inside the kernel (kernels/splitk.py): one launch
  per call;
- one row per program: a batch re-reads the weight per row (from L2 where it fits); kernels/w4a16.py's tiles read
  it once for many rows.

The column order inside a word (AWQ_ORDER: nibble i holds column ``8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``) means the
low half-word holds the even columns and the high half the odd ones: column ``8c + j`` is nibble ``j // 2`` of
half ``j % 2``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.operands import awq_dims, rows
from kernels.splitk import cdiv, num_sms, reduce_splits, split_geometry, store_or_finish, tickets

MAGIC = tl.constexpr(0x4B000000)  # the bits of 2^23 as float32: a value < 2^23 in its mantissa adds to it exactly


@triton.jit
def _column(acc, q_half, z_half, x, s_row_ptr, words, mask_w, J: tl.constexpr):
    """acc ``[W]`` + this K step's contribution of column ``8c + J`` of every word c (J a constant, so the nibble's
    mask and its power of 16 are immediates): ``s 16^-i sum_k x_k ((2^23 + q 16^i) - (2^23 + z 16^i))``, i = J // 2.
    """
    mask: tl.constexpr = 0xF << (4 * (J // 2))
    unscale: tl.constexpr = 1.0 / (1 << (4 * (J // 2)))
    w = ((q_half & mask) | MAGIC).to(tl.float32, bitcast=True)  # [BLOCK_K, W]: 2^23 + q 16^i
    z = ((z_half & mask) | MAGIC).to(tl.float32, bitcast=True)  # [W]
    s = tl.load(s_row_ptr + words * 8 + J, mask=mask_w, other=0.0).to(tl.float32) * unscale
    return acc + tl.sum(x[:, None] * (w - z[None, :]), 0) * s  # (q - z) 16^i is exact


@triton.jit(do_not_specialize=["stride_xm", "stride_om"])
def _awq_gemv_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    out_ptr,
    part_ptr,
    ticket_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    k_per_split,
    packed_n,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr,
    IN_KERNEL: tl.constexpr,
):
    """``out[row, n] = sum_k x[row, k] (q[k, n] - z[g, n]) s[g, n]`` for this program's BLOCK_N columns over its
    split of K (whole groups; BLOCK_K divides GROUP).  One row per program (grid axis 2)."""
    W: tl.constexpr = BLOCK_N // 8
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)
    # packed_n (N / 8) is an argument of its own so that Triton sees its divisibility: a mask that is constant over
    # four words keeps the loads 16 bytes wide
    words = pid_n * W + tl.arange(0, W)
    mask_w = words < packed_n
    w_ptrs = qweight_ptr + words[None, :]
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    a0 = tl.zeros([W], dtype=tl.float32)
    a1 = tl.zeros([W], dtype=tl.float32)
    a2 = tl.zeros([W], dtype=tl.float32)
    a3 = tl.zeros([W], dtype=tl.float32)
    a4 = tl.zeros([W], dtype=tl.float32)
    a5 = tl.zeros([W], dtype=tl.float32)
    a6 = tl.zeros([W], dtype=tl.float32)
    a7 = tl.zeros([W], dtype=tl.float32)
    rows = k_start + tl.arange(0, BLOCK_K)
    q_next = tl.load(
        w_ptrs + rows[:, None].to(tl.int64) * packed_n, mask=mask_w[None, :], other=0, eviction_policy="evict_first"
    )
    for k0 in range(k_start, k_end, BLOCK_K):
        q = q_next
        k_next = tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K)  # past the last step: a re-read, never used
        rows = k_next + tl.arange(0, BLOCK_K)
        q_next = tl.load(
            w_ptrs + rows[:, None].to(tl.int64) * packed_n, mask=mask_w[None, :], other=0, eviction_policy="evict_first"
        )
        g = k0 // GROUP
        z = tl.load(qzeros_ptr + g * packed_n + words, mask=mask_w, other=0)
        x = tl.load(x_row + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)
        s_row = scales_ptr + g * N
        q_hi = q >> 16  # the odd columns' nibbles, in the low half-word
        z_hi = z >> 16
        a0 = _column(a0, q, z, x, s_row, words, mask_w, 0)
        a1 = _column(a1, q_hi, z_hi, x, s_row, words, mask_w, 1)
        a2 = _column(a2, q, z, x, s_row, words, mask_w, 2)
        a3 = _column(a3, q_hi, z_hi, x, s_row, words, mask_w, 3)
        a4 = _column(a4, q, z, x, s_row, words, mask_w, 4)
        a5 = _column(a5, q_hi, z_hi, x, s_row, words, mask_w, 5)
        a6 = _column(a6, q, z, x, s_row, words, mask_w, 6)
        a7 = _column(a7, q_hi, z_hi, x, s_row, words, mask_w, 7)
    # [W, 8] in column order: column 8c + j is a_j[c]
    y = tl.join(tl.join(tl.join(a0, a4), tl.join(a2, a6)), tl.join(tl.join(a1, a5), tl.join(a3, a7)))
    y = tl.reshape(y, (1, BLOCK_N))
    offs_m = row + tl.arange(0, 1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    store_or_finish(
        y, out_ptr, part_ptr, ticket_ptr, offs_m, offs_n, M, N, stride_om, pid_n * M + row, split, SPLITS, IN_KERNEL
    )


def awq_gemv_config(m: int, n: int, k: int, group_size: int, device: torch.device, config: dict | None = None) -> dict:
    """Tiles and K splits by a rule (no autotuner: a first call compiles one kernel), updated by `config`:

    - one warp a program, so that a step's sum over K never crosses warps (shuffles only, no shared memory);
    - 128 columns (one row) or 256 (more) are 64 or 128 bytes of packed words per K row; 64 or 32 rows of them
      per step are 4 KiB, eight 16-byte loads per thread (fewer rows at a small group, which BLOCK_K must
      divide), double-buffered;
    - K is split into whole groups until the programs make about PER_SM (32) programs per SM (unless `config`
      sets SPLITS).
    """
    # the fastest of benchmarks/gemv_sweep.py's tiles on an H200 at the 8B's projections, per row count
    # (docs/decisions/quant-paths.md, "The decode GEMVs swept and re-shaped")
    if m <= 1:
        cfg = dict(BLOCK_N=128, BLOCK_K=min(64, group_size), num_warps=1, PER_SM=32)
    else:
        cfg = dict(BLOCK_N=256, BLOCK_K=min(32, group_size), num_warps=1, PER_SM=32)
    cfg.update(config or {})
    per_sm = cfg.pop("PER_SM")
    if "SPLITS" not in cfg:
        tiles = cdiv(n, cfg["BLOCK_N"]) * max(m, 1)
        target = per_sm * num_sms(device)
        groups = k // group_size
        cfg["SPLITS"] = 1 if tiles >= target else max(1, min(cdiv(target, tiles), groups))
    return cfg


def awq_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    config: dict | None = None,
    in_kernel_sum: bool = True,
) -> torch.Tensor:
    """``x @ W`` for x ``[..., K]`` (fp16, bf16 or fp32) with at most MAX_ROWS rows, W in AWQ's GEMM layout
    (qweight int32 ``[K, N / 8]``, qzeros int32 ``[K / group, N / 8]``, scales ``[K / group, N]``); ``[..., N]`` in
    x's dtype.  `config` overrides awq_gemv_config (and SPLITS); `in_kernel_sum` False sums the splits with a
    second kernel instead."""
    shape = x.shape
    x2 = rows(x)
    m, k, n = awq_dims(x2, qweight, qzeros, scales, group_size)
    if k % group_size or n % 8:
        raise ValueError(f"AWQ tensors {tuple(qweight.shape)}/{tuple(qzeros.shape)} do not fit x [*, {k}] -> {n}")
    cfg = awq_gemv_config(m, n, k, group_size, x2.device, config)
    bn, bk, splits = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("SPLITS")
    if group_size % bk or bn % 8:
        raise ValueError(f"BLOCK_K {bk} must divide the group {group_size}, BLOCK_N {bn} be a multiple of 8")
    # whole groups per split, so that a step never straddles two groups' scales
    splits, k_per_split = split_geometry(k, group_size, splits)
    tiles = cdiv(n, bn)
    ticket = tickets(x2.device, tiles * m) if splits > 1 and in_kernel_sum else None
    in_kernel = ticket is not None
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    if m and n:
        _awq_gemv_kernel[(tiles, splits, m)](
            x2,
            qweight,
            qzeros,
            scales,
            out,
            part,
            ticket if in_kernel else out,
            m,
            n,
            k,
            x2.stride(0),
            n,
            k_per_split,
            n // 8,
            GROUP=group_size,
            BLOCK_N=bn,
            BLOCK_K=bk,
            SPLITS=splits,
            IN_KERNEL=in_kernel,
            **cfg,
        )
        if splits > 1 and not in_kernel:
            out = reduce_splits(part, x.dtype)
    return out.reshape(*shape[:-1], n)
