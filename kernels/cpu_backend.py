"""The CPU backend: kernels/reference.py's interface over a KV cache laid out for the CPU.

The CPU cache is token-major within a block, ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` ("NHD"),
where the GPU's (and the reference's) is head-major ``[..., num_kv_heads, block_size, head_dim]``.  Gathering a
sequence's blocks then gives ``[L, H, D]`` rows whose transpose ``[H, L, D]`` is a strided *view*, which torch's
fused CPU attention (``scaled_dot_product_attention``) reads as it is: one copy of the context per layer instead
of the reference's gather plus permute, and one fused kernel instead of many small matmuls
(docs/decisions/cpu-attention.md has the measurements behind this file's choices).

Decode (one query token per sequence) runs the compiled kernel of kernels/cpu_ext.py when it is built: it reads each
block where it lies instead of gathering the context first, 4-7x faster on bf16 caches.  The gather path below stays for
fp8 caches, prefill chunks over a cached context, and hosts without the kernel.

Block copies (forks, swap) move whole blocks and do not care about the layout; they are the reference's.  The
reference stays the oracle: tests run both on the same keys and values, each in its own layout.

An fp8 cache (kernels/reference.py has the format) is written and gathered as bytes, widened to the query's
dtype after the gather (exact), and its per-head power-of-two scales are applied to the queries (key scale) and
to the output (value scale) instead of to every cached element: exact, since scaling by a power of two is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import cpu_ext, cpu_fused
from kernels.dense_prefill import DenseChunks, dense_prefill
from kernels.reference import FP8, check_kv_scale, copy_blocks, gather_blocks, quantize_fp8, scatter_blocks

__all__ = [
    "write_kv",
    "paged_attention",
    "dense_prefill_lengths",
    "copy_blocks",
    "gather_blocks",
    "scatter_blocks",
    "kv_cache_shape",
]

# Above this many score elements (queries x keys x heads) per group of prefill sequences, the group is split,
# so that a long prompt never needs gigabytes of scratch memory.
_MAX_SCORE_ELEMENTS = 1 << 26


def kv_cache_shape(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store key/value ``[T, num_kv_heads, head_dim]`` into their slots (slot -1: padding, not written),
    quantized with ``kv_scale`` when the cache is fp8."""
    scale = check_kv_scale(kv_cache, kv_scale, heads_dim=3)
    if scale is None and cpu_fused.write_kv(key, value, kv_cache, slot_mapping):
        return  # the compiled copy: one pass, padding skipped inside
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    if scale is not None:  # stored as bytes
        key = quantize_fp8(key, scale[0, :, None]).view(torch.uint8)
        value = quantize_fp8(value, scale[1, :, None]).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    kv_cache[0].view(num_blocks * block_size, heads, dim).index_copy_(0, slots, key.to(kv_cache.dtype))
    kv_cache[1].view(num_blocks * block_size, heads, dim).index_copy_(0, slots, value.to(kv_cache.dtype))


class _Scratch:
    """Reused buffers for the gathered context, one per role ("k", "v", and the fp8 bytes).

    A fresh tensor of this size comes from mmap'd pages that the kernel must fault in and zero on first touch, which
    made the gather several times slower, two thirds of a step at 256 decoding sequences.  The attention
    call reads the gathered view before the next layer overwrites it, so one buffer per role serves every layer.
    Buffers grow to the largest context seen, up to `_SCRATCH_CAP_BYTES` each; a larger gather allocates.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}

    def get(self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        if numel * dtype.itemsize > _SCRATCH_CAP_BYTES:
            return torch.empty(shape, dtype=dtype, device=device)
        # an inference tensor (made under torch.inference_mode, as the engine runs) cannot be written outside
        # that mode, nor a normal one read back as cheaply inside it: one buffer per mode
        key = (role, dtype, device, torch.is_inference_mode_enabled())
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 2 * (0 if buf is None else buf.numel())), dtype=dtype, device=device)
            buf = buf[: min(buf.numel(), _SCRATCH_CAP_BYTES // dtype.itemsize)]
            self.buffers[key] = buf
        return buf[:numel].view(shape)


_SCRATCH_CAP_BYTES = 512 << 20
_scratch = threading.local()  # engines in different threads of one process never share a buffer


def _buffers() -> _Scratch:
    mine = getattr(_scratch, "buffers", None)
    if mine is None:
        mine = _scratch.buffers = _Scratch()
    return mine


def _gather(cache: torch.Tensor, table: torch.Tensor, role: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[B, H, nblk * block_size, D]`` keys (or values) of the sequences whose block rows are `table` ``[B,
    nblk]``: one copy of the blocks into this role's reused buffer, returned as a strided view (no permute).
    An fp8 cache's blocks are gathered as bytes and widened to `dtype`."""
    batch, nblk = table.shape
    _, block_size, heads, dim = cache.shape
    index = table.reshape(-1).long()
    shape = (batch * nblk, block_size, heads, dim)
    scratch = _buffers()
    if cache.dtype == FP8:
        raw = scratch.get(role + "-fp8", shape, torch.uint8, cache.device)
        torch.index_select(cache.view(torch.uint8), 0, index, out=raw)
        rows = scratch.get(role, shape, dtype or torch.float32, cache.device)
        rows.copy_(raw.view(FP8))
    else:
        rows = scratch.get(role, shape, cache.dtype, cache.device)
        torch.index_select(cache, 0, index, out=rows)  # [B * nblk, bs, H, D]
    return rows.view(batch, nblk * block_size, heads, dim).transpose(1, 2)


def _per_query_head(scale: torch.Tensor, heads: int) -> torch.Tensor:
    """A per-KV-head scale ``[H_kv]`` as ``[1, H_q, 1, 1]`` (the query heads of one KV head are adjacent)."""
    return scale.repeat_interleave(heads // scale.shape[0]).view(1, heads, 1, 1)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    num_decodes: int = 0,
    kv_scale: torch.Tensor | None = None,
    dense: DenseChunks | None = None,
    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its paged context; ``[T, Hq, D]`` out.
    `kv_scale`: an fp8 cache's per-head scales.  `dense`: fresh chunks listed last, attended over the step's
    own K/V (`fresh_kv`) without gathering them back out of the cache (kernels/dense_prefill.py)."""
    kv_scale = check_kv_scale(kv_cache, kv_scale, heads_dim=3)
    if out is None:
        out = torch.empty_like(query)
    batch = seq_lens.shape[0]
    if max_query_len == 1 and query.shape[0] == batch:
        num_decodes = batch
    d = num_decodes  # a mixed step lists its one-token sequences first: rows 0..d-1
    paged_end = batch - (dense.num_seqs if dense is not None else 0)
    if d:
        _decode(query[:d], kv_cache, block_tables[:d], seq_lens[:d], scale, out[:d], kv_scale)
    if d < paged_end:
        _prefill(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, out, d, kv_scale, paged_end)
    if dense is not None:
        if fresh_kv is None or kv_scale is not None:
            raise ValueError("dense (fresh) chunks need the step's K/V (fresh_kv) and a 16/32-bit cache")
        dense_prefill(query, *fresh_kv, dense, scale, out)
    return out


def dense_prefill_lengths(
    dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> Callable[[int], bool] | None:
    """Every fresh chunk takes the step's own K/V (one gather of the chunk less per layer; torch's CPU attention
    plans nothing per shape); None for an fp8 cache, whose attention reads the quantized values."""
    return _any_length if kv_dtype == dtype else None


def _any_length(length: int) -> bool:
    return True


def _decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    if kv_scale is None and query.dtype == kv_cache.dtype and cpu_ext.available():
        _decode_in_place(query, kv_cache, block_tables, seq_lens, scale, out)
        return
    batch, heads, dim = query.shape
    block_size = kv_cache.shape[2]
    lens = seq_lens.tolist()
    longest = max(lens)
    nblk = -(-longest // block_size)
    k = _gather(kv_cache[0], block_tables[:, :nblk], "k", query.dtype)
    v = _gather(kv_cache[1], block_tables[:, :nblk], "v", query.dtype)
    mask = None
    if min(lens) < nblk * block_size:  # the padding past each sequence's end (and past its last block)
        position = torch.arange(nblk * block_size, device=query.device)
        mask = position.view(1, 1, 1, -1) < seq_lens.view(batch, 1, 1, 1)
    q = query.to(k.dtype).view(batch, heads, 1, dim)
    if kv_scale is not None:
        q = q * _per_query_head(kv_scale[0], heads).to(q.dtype)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != k.shape[1])
    if kv_scale is not None:
        o = o * _per_query_head(kv_scale[1], heads).to(o.dtype)
    out.copy_(o.view(batch, heads, dim))


def _decode_in_place(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """The compiled kernel (kernels/cpu_ext.py): every block read where it lies, no gather."""
    target = out if out.is_contiguous() else torch.empty_like(query)
    cpu_ext.paged_decode(
        target,
        query.contiguous(),
        kv_cache[0],
        kv_cache[1],
        block_tables.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        scale,
    )
    if target is not out:
        out.copy_(target)


def _prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    first_seq: int,
    kv_scale: torch.Tensor | None = None,
    end_seq: int | None = None,
) -> None:
    """Sequences `first_seq` .. `end_seq` - 1 (chunks of several tokens): those with the same chunk and context
    lengths go through one fused attention call together (a uniform batch is one call per layer)."""
    heads, dim = query.shape[1], query.shape[2]
    block_size = kv_cache.shape[2]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for b in range(first_seq, len(lens) if end_seq is None else end_seq):
        groups.setdefault((starts[b + 1] - starts[b], lens[b]), []).append(b)
    for (q_len, ctx), members in groups.items():
        per_call = max(1, _MAX_SCORE_ELEMENTS // max(1, q_len * ctx * heads))
        for i in range(0, len(members), per_call):
            part = members[i : i + per_call]
            nblk = -(-ctx // block_size)
            table = block_tables[part, :nblk]
            k = _gather(kv_cache[0], table, "k", query.dtype)[:, :, :ctx]
            v = _gather(kv_cache[1], table, "v", query.dtype)[:, :, :ctx]
            rows = torch.cat([torch.arange(starts[b], starts[b] + q_len) for b in part]) if len(part) > 1 else None
            q = query[rows] if rows is not None else query[starts[part[0]] : starts[part[0]] + q_len]
            q = q.view(len(part), q_len, heads, dim).transpose(1, 2).to(k.dtype)
            # query i sits at position ctx - q_len + i and sees every key up to it (bottom-right causal); a chunk
            # that is the whole context (a fresh prompt) is plain causal attention, which the fused kernel does
            # without a mask
            mask = None
            if 1 < q_len < ctx:
                key_pos = torch.arange(ctx, device=query.device).view(1, -1)
                query_pos = torch.arange(ctx - q_len, ctx, device=query.device).view(-1, 1)
                mask = key_pos <= query_pos
            if kv_scale is not None:
                q = q * _per_query_head(kv_scale[0], heads).to(q.dtype)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=1 < q_len == ctx, scale=scale, enable_gqa=heads != k.shape[1]
            )
            if kv_scale is not None:
                o = o * _per_query_head(kv_scale[1], heads).to(o.dtype)
            o = o.transpose(1, 2).reshape(len(part) * q_len, heads, dim)
            if rows is not None:
                out.index_copy_(0, rows, o.to(out.dtype))
            else:
                out[starts[part[0]] : starts[part[0]] + q_len] = o
