"""Triton cache ops over the paged KV cache ``[2, num_blocks, num_kv_heads, block_size, head_dim]``.

- ``write_kv``: store this step's keys/values into their slots (slot -1 = padding, skipped).
- ``copy_blocks``: whole-block copies ``src[i] -> dst[i]`` for K and V (copy-on-write).
- ``gather_blocks`` / ``scatter_blocks``: selected blocks into / out of a contiguous
  ``[2, n, num_kv_heads, block_size, head_dim]`` buffer, the device side of a swap to CPU (one
  contiguous device-to-host copy of the buffer instead of one per block).

All three block operations are one kernel: copy block ``src_idx[i]`` of one tensor to block
``dst_idx[i]`` of another (or the same), chunked along the block's contiguous
``num_kv_heads * block_size * head_dim`` elements.

An fp8 cache (``float8_e4m3fn``, see kernels/reference.py) is written through its bytes: the key
and value are divided by their head's power-of-two scale and encoded by ``kernels.fp8.e4m3_bits``;
block copies move bytes, whatever the dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import e4m3_bits

FP8 = torch.float8_e4m3fn


# Host-side integer helpers (triton.cdiv / next_power_of_2 go through JIT-function dispatch: slow per call).
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    kv_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    t = tl.program_id(0)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    # The row is read together with its slot, not after it (a padding row's K/V are read and dropped): one memory
    # latency less in a kernel that a decode step of a few sequences runs in a few microseconds.
    k = tl.load(key_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        dst = blk * stride_cb + off * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
        if KV_FP8:
            # The cache is passed as its bytes; scales are powers of two, so 1 / scale is exact.
            mask_h = offs_h < NUM_HEADS
            k_inv = 1.0 / tl.load(kv_scale_ptr + offs_h, mask=mask_h, other=1.0)
            v_inv = 1.0 / tl.load(kv_scale_ptr + NUM_HEADS + offs_h, mask=mask_h, other=1.0)
            tl.store(k_cache_ptr + dst, e4m3_bits(k.to(tl.float32) * k_inv[:, None]), mask=mask)
            tl.store(v_cache_ptr + dst, e4m3_bits(v.to(tl.float32) * v_inv[:, None]), mask=mask)
        else:
            tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    src_idx_ptr,
    dst_idx_ptr,
    src_stride_kv,
    src_stride_blk,
    dst_stride_kv,
    dst_stride_blk,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_SRC_IDX: tl.constexpr,
    HAS_DST_IDX: tl.constexpr,
):
    i = tl.program_id(0)
    kv = tl.program_id(1)
    chunk = tl.program_id(2)
    if HAS_SRC_IDX:
        src_blk = tl.load(src_idx_ptr + i).to(tl.int64)
    else:
        src_blk = i.to(tl.int64)
    if HAS_DST_IDX:
        dst_blk = tl.load(dst_idx_ptr + i).to(tl.int64)
    else:
        dst_blk = i.to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    x = tl.load(src_ptr + kv * src_stride_kv + src_blk * src_stride_blk + offs, mask=mask)
    tl.store(dst_ptr + kv * dst_stride_kv + dst_blk * dst_stride_blk + offs, x, mask=mask)


def _inner_contiguous(t: torch.Tensor) -> bool:
    """The (heads, block_size, head_dim) part of each block is one contiguous run of elements."""
    _, _, _, bs, d = t.shape
    return t.stride(4) == 1 and t.stride(3) == d and t.stride(2) == bs * d


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store key/value ``[T, num_kv_heads, head_dim]`` into their slots of ``kv_cache`` (an fp8 cache
    quantized with ``kv_scale`` ``[2, num_kv_heads]``, as kernels/reference.py)."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _, _, num_heads, block_size, head_dim = kv_cache.shape
    if key.shape[1:] != (num_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not fit a cache of {num_heads} heads x {head_dim}"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache's last dimension must be contiguous")
    fp8 = kv_cache.dtype == FP8
    if fp8:
        if kv_scale is None or tuple(kv_scale.shape) != (2, num_heads) or not kv_scale.is_contiguous():
            raise ValueError(f"an fp8 KV cache needs a contiguous kv_scale [2, {num_heads}]")
        kv_cache = kv_cache.view(torch.uint8)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        kv_scale if fp8 else slot_mapping,  # unused without fp8
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=_next_pow2(num_heads),
        HEAD_DIM_PAD=_next_pow2(head_dim),
        BLOCK_SIZE=block_size,
        KV_FP8=fp8,
        num_warps=4 if num_heads * head_dim >= 1024 else 1,
    )


def _copy(
    src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor | None, dst_idx: torch.Tensor | None, n: int
) -> None:
    if n == 0:
        return
    if src.dtype == FP8:  # bytes are bytes (and every Triton version loads and stores uint8)
        src = src.view(torch.uint8)
    if dst.dtype == FP8:
        dst = dst.view(torch.uint8)
    if not (_inner_contiguous(src) and _inner_contiguous(dst)):
        raise ValueError("each block's (heads, block_size, head_dim) must be contiguous")
    numel = src.shape[2] * src.shape[3] * src.shape[4]
    chunk = min(_next_pow2(numel), 4096)
    dummy = src_idx if src_idx is not None else dst_idx
    _copy_blocks_kernel[(n, 2, _cdiv(numel, chunk))](
        src,
        dst,
        src_idx if src_idx is not None else dummy,
        dst_idx if dst_idx is not None else dummy,
        src.stride(0),
        src.stride(1),
        dst.stride(0),
        dst.stride(1),
        BLOCK_NUMEL=numel,
        CHUNK=chunk,
        HAS_SRC_IDX=src_idx is not None,
        HAS_DST_IDX=dst_idx is not None,
        num_warps=4,
    )


def _on(idx: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    if not isinstance(idx, torch.Tensor):
        idx = torch.tensor(idx, dtype=torch.int64)
    return idx.to(device, non_blocking=True)


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks ``src[i] -> dst[i]`` (K and V).  No block of ``dst`` may appear in ``src``
    (copy-on-write targets are fresh blocks), since the copies run in parallel."""
    src, dst = _on(src, kv_cache.device), _on(dst, kv_cache.device)
    if src.shape != dst.shape:
        raise ValueError(f"{src.shape[0]} source blocks but {dst.shape[0]} destinations")
    _copy(kv_cache, kv_cache, src, dst, src.shape[0])


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks ``block_ids`` of the cache, K and V, as a contiguous ``[2, n, H, block_size, D]`` tensor."""
    block_ids = _on(block_ids, kv_cache.device)
    n = block_ids.shape[0]
    if out is None:
        out = torch.empty((2, n) + tuple(kv_cache.shape[2:]), dtype=kv_cache.dtype, device=kv_cache.device)
    _copy(kv_cache, out, block_ids, None, n)
    return out


def scatter_blocks(kv_cache: torch.Tensor, src: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Write ``src[:, i]`` (``[2, n, H, block_size, D]``, e.g. swapped-in blocks) into block ``block_ids[i]``."""
    block_ids = _on(block_ids, kv_cache.device)
    if src.device != kv_cache.device:
        src = src.to(kv_cache.device, non_blocking=True)
    if src.dtype != kv_cache.dtype:
        src = src.to(kv_cache.dtype)
    _copy(src, kv_cache, None, block_ids, block_ids.shape[0])
