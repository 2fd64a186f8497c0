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


# -- split-K finished inside the kernel ----------------------------------------------------------------------
#
# A decode GEMV reads its weight in a few microseconds; a second kernel to sum the splits costs a launch gap and a
# ramp-up of its own.  Instead every split stores its float32 partial, then takes a ticket from a per-tile counter
# (an acq_rel atomic after a CTA barrier, so that the CTA's stores are visible before the ticket is); the split
# that draws the last ticket sums the partials in split order (deterministic) into the output and resets the
# counter to zero for the next call.  The counters are one zeroed int32 buffer per device, reset by the kernels
# themselves, so that a captured CUDA graph needs no memset.  Two such kernels must not run at once on one device
# on two streams (the engine runs its forward on one stream).

_TICKETS: dict[torch.device, torch.Tensor] = {}
TICKETS_MIN = 1 << 16  # tiles: 65,536 counters (256 KiB) cover N = 28,672 in 8-column tiles 16 times over


def tickets(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's zeroed counter buffer with at least `tiles` entries, or None where it would have to be
    allocated (or grown) during a CUDA graph capture: the caller then finishes its splits with `reduce_splits`."""
    buf = _TICKETS.get(device)
    if buf is None or buf.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _TICKETS[device] = torch.zeros(max(TICKETS_MIN, tiles), dtype=torch.int32, device=device)
    return buf


@triton.jit
def store_or_finish(
    y,
    out_ptr,
    part_ptr,
    ticket_ptr,
    offs_m,
    offs_n,
    M,
    N,
    stride_om,
    tile,
    split,
    SPLITS: tl.constexpr,
    IN_KERNEL: tl.constexpr,
):
    """Store this program's float32 ``[BLOCK_M, BLOCK_N]`` result `y`: the output itself when K is not split;
    else its partial (``part_ptr`` ``[SPLITS, M, N]``), and with IN_KERNEL the last split of the tile sums them
    into the output (without it `reduce_splits` does, after the kernel)."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLITS == 1:
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        plane = M * N
        part = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part + split.to(tl.int64) * plane, y, mask=mask)
        if IN_KERNEL:
            tl.debug_barrier()  # every thread's partial is stored before thread 0 takes the ticket
            ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel")
            if ticket == SPLITS - 1:  # the last split of this tile: every other partial is visible
                total = tl.zeros(y.shape, dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    total += tl.load(part + s * plane, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(ticket_ptr + tile, 0, sem="relaxed")
