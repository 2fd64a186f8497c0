"""Triton: ``x @ W`` for AWQ int4 weights on the tensor cores, the weight dequantized inside the K loop from a
layout repacked once at load (`awq_repack`), for products of a few rows to about a hundred.

Why a second layout.  AutoAWQ packs eight *columns* of one K row into an int32 (kernels/quant_reference.py), so a
tile built from it has to interleave the eight nibble planes along N: a reshape that Triton lowers to register
shuffles before the tile reaches the tensor cores.  Here an int32 holds eight *K rows* of one column, a plane per
16-row slice of a 128-row block:

    packed[b * 16 + r, n], nibble p  =  W[b * 128 + p * 16 + r, n]        (b: 128-row block, r < 16, p < 8)

so nibble plane ``p`` of a ``[16, BLOCK_N]`` tile of words is the weight's ``[16, BLOCK_N]`` slice ``p`` of the
block, with no data movement at all: the eight planes side by side are the block's operand of one ``tl.dot`` of
K = 128 (`ONE_DOT`, the default: each thread keeps the values it computed), or each plane is one dot of K = 16.
The packed tensor has qweight's size (``[K / 8, N]`` int32); the zero points are stored beside it as float16
``1024 + z`` (``[K / group, N]``, the size of the scales), ready for the subtraction below.

The dequantization is exact: ``(p | 0x6400)`` read as float16 is ``1024 + p``; minus ``1024 + z`` is ``p - z``
exactly, and one multiplication by the float16 scale rounds once, so the float16 weight is bit for bit the
reference's.  On the GPU (`FAST`) one ``lop3`` turns two nibbles of a word into a float16 pair and the subtraction
and multiplication run on pairs (``sub.f16x2``, ``mul.f16x2``): about two instructions per weight element.  That
pair holds planes p and p + 4 of one word, where the MMA's register operand wants two K rows of one plane, so the
compiler re-pairs the halves (a ``prmt`` per register); `WORD_PAIRS` instead takes two words (rows r and r + 1 of a
column) a step and builds the operand's pairs directly (8 instead of 32 ``prmt`` a step of the 128 x 128 tile,
compiled for sm_90).  The interpreter (and bf16 or float32 activations) take the same arithmetic in plain Triton
operations.

Tiles: `SWAP_AB` puts the dequantized weight on the MMA's 64-row side (output columns by rows of x), where a
few dozen rows of x would waste most of a 64-row MMA; without it x is the left operand.  Split-K partials are
summed by kernels/splitk.py: by the last split of each tile inside the kernel (IN_KERNEL), or by its second
kernel.  Which tiles run at which shape: `tc_config` (docs/decisions/quant-paths.md has the sweep it follows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import quant_reference as qr
from kernels.operands import rows
from kernels.splitk import cdiv, reduce_splits, split_geometry, split_k, store_or_finish, tickets

BLOCK_ROWS = 128  # K rows per packed block: 8 planes of 16
PLANE = BLOCK_ROWS // 8

_F16_PAIR_ASM = """
{
.reg .b32 t0, t1, t2, t3, q1, q2, q3, zz, ss;
mov.b32 zz, {$9, $9};
mov.b32 ss, {$10, $10};
shr.u32 q1, $8, 4;
shr.u32 q2, $8, 8;
shr.u32 q3, $8, 12;
lop3.b32 t0, $8, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t1, q1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t2, q2, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t3, q3, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t0, t0, zz;
sub.f16x2 t1, t1, zz;
sub.f16x2 t2, t2, zz;
sub.f16x2 t3, t3, zz;
mul.f16x2 t0, t0, ss;
mul.f16x2 t1, t1, ss;
mul.f16x2 t2, t2, ss;
mul.f16x2 t3, t3, ss;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}
"""
_F16_PAIR_ASM_C = tl.constexpr(_F16_PAIR_ASM)  # $0-$7: planes 0-7; $8: the word; $9: 1024 + z; $10: the scale

# Two words a step (`WORD_PAIRS`, pack=2): the halves of each float16 pair come from the two words, not from two
# planes of one word, so every output register already holds two elements of one plane (the MMA operand's pairs
# are two K rows of one plane when Triton hands the asm words r and r + 1 of a column) and no repacking follows.
# prmt puts the low 16 bits of both words in one register (nibbles 0-3 of each) and the high 16 bits in another.
_F16_WORD_PAIRS_ASM = """
{
.reg .b32 lo, hi, u1, u2, u3, v1, v2, v3, t0, t1, t2, t3, t4, t5, t6, t7;
prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
shr.u32 u1, lo, 4;
shr.u32 u2, lo, 8;
shr.u32 u3, lo, 12;
shr.u32 v1, hi, 4;
shr.u32 v2, hi, 8;
shr.u32 v3, hi, 12;
lop3.b32 t0, lo, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t1, u1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t2, u2, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t3, u3, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t4, hi, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t5, v1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t6, v2, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t7, v3, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t0, t0, $10;
sub.f16x2 t1, t1, $10;
sub.f16x2 t2, t2, $10;
sub.f16x2 t3, t3, $10;
sub.f16x2 t4, t4, $10;
sub.f16x2 t5, t5, $10;
sub.f16x2 t6, t6, $10;
sub.f16x2 t7, t7, $10;
mul.f16x2 $0, t0, $11;
mul.f16x2 $1, t1, $11;
mul.f16x2 $2, t2, $11;
mul.f16x2 $3, t3, $11;
mul.f16x2 $4, t4, $11;
mul.f16x2 $5, t5, $11;
mul.f16x2 $6, t6, $11;
mul.f16x2 $7, t7, $11;
}
"""
# $0-$7: planes 0-7, each a pair of the two words' elements; $8, $9: the words; $10: 1024 + z pair; $11: scale pair
_F16_WORD_PAIRS_ASM_C = tl.constexpr(_F16_WORD_PAIRS_ASM)


@triton.jit
def _plane(q, zf, s, P: tl.constexpr, F16: tl.constexpr, DTYPE: tl.constexpr):
    """Nibble plane P of the words `q`: ``(q_p - z) x s`` in DTYPE (`zf` is ``1024 + z`` in float16; F16: DTYPE is
    float16, where the exact difference times the scale rounds once in float16 arithmetic)."""
    nib = (q >> (4 * P)) & 0xF
    if F16:
        w = ((nib | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - zf) * s.to(tl.float16)
    else:
        w = ((nib.to(tl.float32) - (zf.to(tl.float32) - 1024.0)) * s.to(tl.float32)).to(DTYPE)
    return w


@triton.jit
def _group_rows(zf_ptr, scales_ptr, g, N, offs_n, mask_n, q, SWAP_AB: tl.constexpr):
    """Group g's ``1024 + z`` and scales for the tile's columns, broadcast to the shape of the words `q`."""
    zf = tl.load(zf_ptr + g * N + offs_n, mask=mask_n, other=1024.0)
    s = tl.load(scales_ptr + g * N + offs_n, mask=mask_n, other=0.0)
    if SWAP_AB:
        zf2 = tl.broadcast_to(zf[:, None], q.shape)
        s2 = tl.broadcast_to(s[:, None], q.shape)
    else:
        zf2 = tl.broadcast_to(zf[None, :], q.shape)
        s2 = tl.broadcast_to(s[None, :], q.shape)
    return zf2, s2


@triton.jit
def _plane_of_group(
    q,
    zf_ptr,
    scales_ptr,
    k_base,
    N,
    offs_n,
    mask_n,
    P: tl.constexpr,
    GROUP: tl.constexpr,
    SWAP_AB: tl.constexpr,
    F16: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """Plane P dequantized with its own group's zero points and scales (the portable path)."""
    zf2, s2 = _group_rows(zf_ptr, scales_ptr, (k_base + P * 16) // GROUP, N, offs_n, mask_n, q, SWAP_AB)
    return _plane(q, zf2, s2, P, F16, DTYPE)


@triton.jit
def _dot_plane(acc, x_rows, mask_x, k_base, w, P: tl.constexpr, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_k = k_base + P * 16 + tl.arange(0, 16)
    if SWAP_AB:  # w [BLOCK_N, 16] x x^T [16, BLOCK_M]
        xt = tl.load(x_rows[None, :] + offs_k[:, None], mask=mask_x[None, :], other=0.0)
        acc = tl.dot(w.to(xt.dtype), xt, acc, input_precision=DOT_PRECISION)
    else:  # x [BLOCK_M, 16] x w [16, BLOCK_N]
        xs = tl.load(x_rows[:, None] + offs_k[None, :], mask=mask_x[:, None], other=0.0)
        acc = tl.dot(xs, w.to(xs.dtype), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _cat8(w0, w1, w2, w3, w4, w5, w6, w7, SWAP_AB: tl.constexpr):
    """Eight planes (``[BLOCK_N, 16]`` with SWAP_AB, else ``[16, BLOCK_N]``) as one ``[BLOCK_N, 128]`` (``[128,
    BLOCK_N]``) tile, plane p at K rows ``16 p ..``: nested joins put p in registers, the permute and reshape only
    rename dimensions (each thread keeps the values it computed)."""
    # tl.join appends its selector as the last dimension, so the innermost join picks the high bit of p
    j = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
    j = tl.reshape(j, (j.shape[0], j.shape[1], 8))
    if SWAP_AB:  # [BN, 16, 8] -> [BN, 8 planes, 16] -> [BN, 128]
        w = tl.reshape(tl.permute(j, (0, 2, 1)), (j.shape[0], 128))
    else:  # [16, BN, 8] -> [8, 16, BN] -> [128, BN]
        w = tl.reshape(tl.permute(j, (2, 0, 1)), (128, j.shape[1]))
    return w


@triton.jit
def _dot_block(acc, x_rows, mask_x, k_base, w, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_k = k_base + tl.arange(0, 128)
    if SWAP_AB:
        xt = tl.load(x_rows[None, :] + offs_k[:, None], mask=mask_x[None, :], other=0.0)
        acc = tl.dot(w.to(xt.dtype), xt, acc, input_precision=DOT_PRECISION)
    else:
        xs = tl.load(x_rows[:, None] + offs_k[None, :], mask=mask_x[:, None], other=0.0)
        acc = tl.dot(xs, w.to(xs.dtype), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _w4a16_tc_kernel(
    x_ptr,
    packed_ptr,
    zf_ptr,
    scales_ptr,
    out_ptr,
    part_ptr,
    ticket_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    blocks_per_split,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SWAP_AB: tl.constexpr,
    FAST: tl.constexpr,
    WORD_PAIRS: tl.constexpr,
    ONE_DOT: tl.constexpr,
    F16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLITS: tl.constexpr,
    IN_KERNEL: tl.constexpr,
    EVEN_M: tl.constexpr = False,
    EVEN_N: tl.constexpr = False,
):
    """This program's ``[BLOCK_M, BLOCK_N]`` output tile over its split of K, 128 K rows (one packed block) a step.
    GROUP is a multiple of 16: a plane lies in one group."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    tl.assume(stride_xm % 8 == 0)
    tl.assume(N % 8 == 0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    offs_r = tl.arange(0, 16)
    # whole tiles (EVEN_M, EVEN_N: M and N multiples of the tile) load without masks: no predicates per copy
    if EVEN_M:
        mask_m = tl.full([BLOCK_M], 1, tl.int1)
    else:
        mask_m = offs_m < M
    if EVEN_N:
        mask_n = tl.full([BLOCK_N], 1, tl.int1)
    else:
        mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_start = split * blocks_per_split
    b_end = tl.minimum(b_start + blocks_per_split, K // 128)
    for b in range(b_start, b_end):
        words = packed_ptr + (b * 16 + offs_r).to(tl.int64) * N
        k_base = b * 128
        if SWAP_AB:
            q = tl.load(words[None, :] + offs_n[:, None], mask=mask_n[:, None], other=0)  # [BLOCK_N, 16]
        else:
            q = tl.load(words[:, None] + offs_n[None, :], mask=mask_n[None, :], other=0)  # [16, BLOCK_N]
        if FAST and GROUP >= 128:  # one group for the block; the pairs' arithmetic (float16 activations)
            zf2, s2 = _group_rows(zf_ptr, scales_ptr, k_base // GROUP, N, offs_n, mask_n, q, SWAP_AB)
            if WORD_PAIRS:
                w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                    _F16_WORD_PAIRS_ASM_C,
                    "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
                    [q, zf2, s2.to(tl.float16)],
                    dtype=(tl.float16,) * 8,
                    is_pure=True,
                    pack=2,
                )
            else:
                w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                    _F16_PAIR_ASM_C,
                    "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h",
                    [q, zf2, s2.to(tl.float16)],
                    dtype=(tl.float16,) * 8,
                    is_pure=True,
                    pack=1,
                )
        else:
            w0 = _plane_of_group(q, zf_ptr, scales_ptr, k_base, N, offs_n, mask_n, 0, GROUP, SWAP_AB, F16, DTYPE)
            w1 = _plane_of_group(q, zf_ptr, scales_ptr, k_base, N, offs_n, mask_n, 1, GROUP, SWAP_AB, F16, DTYPE)
            w2 = _plane_of_group(q, zf_ptr, scales_ptr, k_base, N, offs_n, mask_n, 2, GROUP, SWAP_AB, F16, DTYPE)
            w3 = _plane_of_group(q, zf_ptr, scales_ptr, k_base, N, offs_n, mask_n, 3, GROUP, SWAP_AB, F16, DTYPE)
            w4 = _plane_of_group(q, zf_ptr, scales_ptr, k_base, N, offs_n, mask_n, 4, GROUP, SWAP_AB, F16, DTYPE)
            w5 = _plane_of_group(q, zf_ptr, scales_ptr, k_base, N, offs_n, mask_n, 5, GROUP, SWAP_AB, F16, DTYPE)
            w6 = _plane_of_group(q, zf_ptr, scales_ptr, k_base, N, offs_n, mask_n, 6, GROUP, SWAP_AB, F16, DTYPE)
            w7 = _plane_of_group(q, zf_ptr, scales_ptr, k_base, N, offs_n, mask_n, 7, GROUP, SWAP_AB, F16, DTYPE)
        if ONE_DOT:  # the planes side by side along K: one dot of K = 128
            w = _cat8(w0, w1, w2, w3, w4, w5, w6, w7, SWAP_AB)
            acc = _dot_block(acc, x_rows, mask_m, k_base, w, SWAP_AB, DOT_PRECISION)
        else:  # a dot of K = 16 per plane
            acc = _dot_plane(acc, x_rows, mask_m, k_base, w0, 0, SWAP_AB, DOT_PRECISION)
            acc = _dot_plane(acc, x_rows, mask_m, k_base, w1, 1, SWAP_AB, DOT_PRECISION)
            acc = _dot_plane(acc, x_rows, mask_m, k_base, w2, 2, SWAP_AB, DOT_PRECISION)
            acc = _dot_plane(acc, x_rows, mask_m, k_base, w3, 3, SWAP_AB, DOT_PRECISION)
            acc = _dot_plane(acc, x_rows, mask_m, k_base, w4, 4, SWAP_AB, DOT_PRECISION)
            acc = _dot_plane(acc, x_rows, mask_m, k_base, w5, 5, SWAP_AB, DOT_PRECISION)
            acc = _dot_plane(acc, x_rows, mask_m, k_base, w6, 6, SWAP_AB, DOT_PRECISION)
            acc = _dot_plane(acc, x_rows, mask_m, k_base, w7, 7, SWAP_AB, DOT_PRECISION)
    if SWAP_AB:
        acc = tl.trans(acc)
    tile = pid_m * tl.num_programs(0) + pid_n
    store_or_finish(acc, out_ptr, part_ptr, ticket_ptr, offs_m, offs_n, M, N, stride_om, tile, split, SPLITS, IN_KERNEL)


@triton.jit
def _tc_dequant_kernel(
    packed_ptr,
    zf_ptr,
    scales_ptr,
    out_ptr,
    N,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F16: tl.constexpr,
):
    """One packed block's 128 K rows of ``[K, N]`` in the output dtype: the words ``[16, BLOCK_N]`` read once, their
    eight planes written as rows ``b * 128 + p * 16 ..``."""
    b = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, 16)
    mask_n = offs_n < N
    q = tl.load(packed_ptr + (b * 16 + offs_r)[:, None].to(tl.int64) * N + offs_n[None, :], mask=mask_n[None, :])
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    for p in tl.static_range(8):
        w = _plane_of_group(q, zf_ptr, scales_ptr, b * 128, N, offs_n, mask_n, p, GROUP, False, F16, DTYPE)
        rows_p = (b * 128 + p * 16 + offs_r).to(tl.int64)
        tl.store(out_ptr + rows_p[:, None] * N + offs_n[None, :], w, mask=mask_n[None, :])


def tc_dequantize(
    packed: torch.Tensor, zf: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The weight ``[K, N]`` in `dtype` from `awq_repack`'s layout, for products of many rows (cuBLAS then runs at
    the matmul rate): the same values as quant_reference.awq_dequantize of the checkpoint's tensors, so a layer
    that keeps only the repacked weight needs no other copy."""
    k8, n = packed.shape
    if zf.shape != scales.shape or scales.shape[0] * group_size != k8 * 8 or (k8 * 8) % BLOCK_ROWS:
        raise ValueError(f"repacked AWQ tensors {tuple(packed.shape)}/{tuple(zf.shape)} do not fit group {group_size}")
    out = torch.empty((k8 * 8, n), dtype=dtype, device=packed.device)
    block_n = 256
    _tc_dequant_kernel[(k8 * 8 // BLOCK_ROWS, cdiv(n, block_n))](
        packed, zf, scales, out, n, GROUP=group_size, BLOCK_N=block_n, F16=dtype == torch.float16, num_warps=4
    )
    return out


# -- the load-time layout ------------------------------------------------------------------------------------


def awq_repack(qweight: torch.Tensor, qzeros: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed ``[K / 8, N]`` int32 in this kernel's K-plane order, zf ``[K / group, N]`` float16 ``1024 + z``) from
    AutoAWQ's qweight ``[K, N / 8]`` and qzeros; on qweight's device, in torch ops (once, at load)."""
    k = qweight.shape[0]
    if k % BLOCK_ROWS or group_size % PLANE:
        raise ValueError(
            f"the tensor-core AWQ layout needs K ({k}) a multiple of 128 and a group size "
            f"({group_size}) a multiple of 16"
        )
    w = qr.unpack_int4(qweight)  # [K, N] int32 values 0..15
    n = w.shape[1]
    # [blocks, plane p, row r, N] -> [blocks, r, N, p]: nibble p of word (b, r, n)
    planes = w.reshape(k // BLOCK_ROWS, 8, PLANE, n).permute(0, 2, 3, 1)
    shifts = torch.arange(0, 32, 4, device=w.device, dtype=torch.int64)
    packed = (planes.to(torch.int64) << shifts).sum(-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    zf = (qr.unpack_int4(qzeros).to(torch.float32) + 1024.0).to(torch.float16)
    return packed.reshape(k // 8, n).contiguous(), zf.contiguous()


def awq_unrepack(packed: torch.Tensor) -> torch.Tensor:
    """The int4 values ``[K, N]`` (0..15) of a packed tensor: the inverse of `awq_repack`'s qweight half (tests)."""
    k8, n = packed.shape
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    planes = (packed.reshape(k8 // PLANE, PLANE, n, 1) >> shifts) & 0xF  # [blocks, r, N, p]
    return planes.permute(0, 3, 1, 2).reshape(k8 * 8, n)


# -- tiles ---------------------------------------------------------------------------------------------------


def tc_config(m: int, n: int, k: int) -> dict:
    """Tiles by row count (`python -m benchmarks.quant_kernels --tc` sweeps them; docs/decisions/quant-paths.md has
    the table): the weight on the MMA's 64-row side always (x on it was 3-6x slower); up to 64 rows one tile of
    rows, 64 columns, one warp group, K split for about WAVES programs per SM; up to 16 rows a dot of K = 16 per
    nibble plane (ONE_DOT False: the eight planes joined for one dot of K = 128 cost more than the dot saves
    there, less from 32 rows) and the splits summed by the last of them inside the kernel (IN_KERNEL: no second
    launch); above 64 rows, 128 x 128 with two warp groups (four warps would hold a 128 x 128 float32 accumulator
    in 128 registers each, and were 2x slower).  Up to 16 rows also two words a dequantization step (WORD_PAIRS)
    and whole tiles loaded without masks (EVEN): faster at 1 row, slower from 32 (docs/decisions/quant-paths.md)."""
    if m <= 64:
        small = m <= 16
        return dict(
            BLOCK_M=max(16, triton.next_power_of_2(m)),
            BLOCK_N=64,
            SWAP_AB=True,
            num_warps=4,
            num_stages=3,
            WAVES=4,
            ONE_DOT=not small,
            IN_KERNEL=small,
            WORD_PAIRS=small,
            EVEN=small,
        )
    return dict(BLOCK_M=128, BLOCK_N=128, SWAP_AB=True, num_warps=8, num_stages=3)


def w4a16_tc(
    x: torch.Tensor,
    packed: torch.Tensor,
    zf: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    config: dict | None = None,
    splits: int | None = None,
    fast: bool | None = None,
) -> torch.Tensor:
    """``x @ W`` for x ``[..., K]`` (float16, bfloat16 or float32) and W as `awq_repack` stored it; ``[..., N]`` in
    x's dtype.  `splits`: K splits (default: about `WAVES` programs per SM, a config key, 2 unless given); `fast`:
    the paired float16 dequantization (default: float16 activations on a GPU).  Config keys beside the tile:
    ONE_DOT (default True), IN_KERNEL (the splits summed inside the kernel, kernels/splitk.py; default False),
    WORD_PAIRS (with `fast`: two words a dequantization step, `_F16_WORD_PAIRS_ASM`; default False) and EVEN (the
    loads unmasked where M and N are multiples of the tile; default False)."""
    shape = x.shape
    x2 = rows(x)
    m, k = x2.shape
    n = scales.shape[1]
    if packed.shape != (k // 8, n) or zf.shape != scales.shape or scales.shape[0] * group_size != k or k % BLOCK_ROWS:
        raise ValueError(f"repacked AWQ tensors {tuple(packed.shape)}/{tuple(zf.shape)} do not fit x [*, {k}] -> {n}")
    if x2.stride(0) % 8:
        x2 = x2.contiguous()
    cfg = dict(tc_config(m, n, k), **(config or {}))
    bm, bn, swap = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("SWAP_AB")
    one_dot = cfg.pop("ONE_DOT", True)
    word_pairs = cfg.pop("WORD_PAIRS", False)
    even = cfg.pop("EVEN", False)
    in_kernel = cfg.pop("IN_KERNEL", False)
    waves = cfg.pop("WAVES", 2)
    if fast is None:
        fast = x.dtype == torch.float16 and x.device.type == "cuda"
    m_tiles, n_tiles = cdiv(m, bm), cdiv(n, bn)
    if splits is None:
        splits = split_k(k, BLOCK_ROWS, m_tiles * n_tiles, x2.device, waves=waves)
    splits, k_per_split = split_geometry(k, BLOCK_ROWS, splits)
    ticket = tickets(x2.device, m_tiles * n_tiles) if splits > 1 and in_kernel else None
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    if m:
        _w4a16_tc_kernel[(n_tiles, m_tiles, splits)](
            x2,
            packed,
            zf,
            scales,
            out,
            part,
            out if ticket is None else ticket,
            m,
            n,
            k,
            x2.stride(0),
            n,
            k_per_split // BLOCK_ROWS,
            GROUP=group_size,
            BLOCK_M=bm,
            BLOCK_N=bn,
            SWAP_AB=swap,
            FAST=fast,
            WORD_PAIRS=word_pairs,
            ONE_DOT=one_dot,
            F16=x.dtype == torch.float16,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            SPLITS=splits,
            IN_KERNEL=ticket is not None,
            EVEN_M=even and m % bm == 0,
            EVEN_N=even and n % bn == 0,
            **cfg,
        )
        if splits > 1 and ticket is None:
            out = reduce_splits(part, x.dtype)
    return out.reshape(*shape[:-1], n)
