"""What the quantized small-M kernels share: how many K splits a product gets, and the one kernel that sums
the splits' float32 partials into the output dtype.

A decode product of a few rows has too few output tiles to keep every SM loading; splitting K multiplies the
programs.  The partials ``[splits, M, N]`` are summed in a fixed order by one kernel that also casts (a
``sum(0).to(dtype)`` costs two kernels and a float32 round trip), so results do not depend on timing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small, so that the tests exercise split-K


def split_k(k: int, block_k: int, programs: int, device: torch.device, waves: int = 2, min_tiles: int = 4) -> int:
    """Splits of K so that `programs` output tiles become about `waves` programs per SM, each keeping at least
    `min_tiles` K tiles (fewer make the partials' traffic and the sum dominate)."""
    target = waves * num_sms(device)
    if programs >= target:
        return 1
    return max(1, min(cdiv(target, programs), k // (min_tiles * block_k)))


def split_geometry(k: int, block_k: int, splits: int) -> tuple[int, int]:
    """(splits, rows of K per split): whole BLOCK_K tiles per split, and no split left empty."""
    k_per_split = cdiv(cdiv(k, max(splits, 1)), block_k) * block_k
    return cdiv(k, k_per_split), k_per_split


@triton.jit
def _reduce_kernel(part_ptr, out_ptr, total, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def reduce_splits(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``partials.sum(0)`` in `dtype`, by one kernel (partials ``[splits, M, N]`` float32, contiguous)."""
    splits, m, n = partials.shape
    out = torch.empty((m, n), dtype=dtype, device=partials.device)
    total = m * n
    if total:
        block = 1024
        _reduce_kernel[(cdiv(total, block),)](partials, out, total, SPLITS=splits, BLOCK=block, num_warps=4)
    return out
