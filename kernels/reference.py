"""Plain-torch paged attention and cache ops: the CPU path and the oracle for the Triton kernels.

KV cache layout, one tensor per layer: ``[2, num_blocks, num_kv_heads, block_size, head_dim]``
(index 0 holds keys, 1 values).  A block of one head is one contiguous ``block_size x head_dim``
tile, which is what a GPU kernel wants to load; the block id is the second index so that swapping
or copying a block is one indexed copy over both K and V.

Token positions map to cache slots through a slot number ``block_id * block_size + offset``;
slot -1 means "do not write" (padding).

Attention metadata for a batch of sequences (flattened along tokens):

- ``query_start_loc`` ``[B + 1]`` int32: sequence b's query tokens are rows
  ``query_start_loc[b]:query_start_loc[b + 1]`` of ``query``;
- ``seq_lens`` ``[B]`` int32: tokens of context *including* this step's queries, so the queries of
  sequence b sit at positions ``seq_lens[b] - q_len_b .. seq_lens[b] - 1`` and attend causally to
  every earlier position (earlier chunks and prefix-cache hits come from the cache);
- ``block_tables`` ``[B, max_blocks]`` int32, padded with any valid block id.

Decode is the case q_len = 1 for every sequence; prefill, chunked prefill and extend are the
general case.  All math is done in float32.

FP8 KV cache (``--kv-cache-dtype fp8``): the cache tensor is ``float8_e4m3fn`` and every layer has
``kv_scale`` ``[2, num_kv_heads]`` float32 (row 0 keys, row 1 values), powers of two.  A stored
element is ``round_to_e4m3(clamp(x / scale, -448, 448))`` and reads back as ``stored * scale``.
Because the scale is a power of two, dividing and multiplying by it are exact: the e4m3 rounding
is the only error, and the Triton kernels reproduce this reference bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` (scale a power of two, broadcast against x) clamped to the e4m3 range and rounded
    to nearest even.  Clamped first: a value past 448 saturates instead of becoming NaN."""
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def check_kv_scale(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, heads_dim: int = 2) -> torch.Tensor | None:
    """The scales an fp8 cache needs (None for a 16/32-bit cache, whose values are stored as they are);
    `heads_dim` is the cache's KV-head axis (2 head-major, 3 for the CPU backend's token-major layout)."""
    if kv_cache.dtype != FP8:
        return None
    if kv_scale is None:
        raise ValueError("an fp8 KV cache needs kv_scale [2, num_kv_heads] (keys' and values' scales)")
    if tuple(kv_scale.shape) != (2, kv_cache.shape[heads_dim]):
        raise ValueError(f"kv_scale must be [2, {kv_cache.shape[heads_dim]}], got {tuple(kv_scale.shape)}")
    return kv_scale


# Above this many score elements (batch x query x key x heads) per call, sequences are processed in
# smaller groups so that a long prefill on the CPU does not need gigabytes of scratch memory.
_MAX_SCORE_ELEMENTS = 1 << 26


def kv_cache_shape(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int) -> tuple[int, ...]:
    return (2, num_blocks, num_kv_heads, block_size, head_dim)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store key/value ``[T, num_kv_heads, head_dim]`` into their slots of ``kv_cache`` (quantized
    with ``kv_scale`` when the cache is fp8)."""
    scale = check_kv_scale(kv_cache, kv_scale)
    block_size = kv_cache.shape[3]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    if scale is not None:
        key, value = quantize_fp8(key, scale[0, :, None]), quantize_fp8(value, scale[1, :, None])
    # Advanced indices separated by a slice put the indexed dimension first: [T, H, D].
    kv_cache[0][blocks, :, offsets] = key.to(kv_cache.dtype)
    kv_cache[1][blocks, :, offsets] = value.to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous ``[B, num_kv_heads, max_len, head_dim]`` keys and values read through block tables."""
    _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    nblk = -(-max_len // block_size)
    table = block_tables[:, :nblk].long()
    batch = table.shape[0]

    def one(cache: torch.Tensor) -> torch.Tensor:
        x = cache[table]  # [B, nblk, H, bs, D]
        x = x.permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, nblk * block_size, head_dim)
        return x[:, :, :max_len]

    return one(kv_cache[0]), one(kv_cache[1])


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
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its paged context; ``[T, Hq, D]`` out.

    `num_decodes` is the GPU backend's hint for mixed steps (see kernels/triton_backend.py); the
    math here is the same for every sequence, so it is unused.  `kv_scale`: an fp8 cache's scales.
    """
    kv_scale = check_kv_scale(kv_cache, kv_scale)
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    heads = query.shape[1]
    start = 0
    while start < num_seqs:
        end = start + 1
        while end < num_seqs and (end + 1 - start) * max_query_len * max_seq_len * heads <= _MAX_SCORE_ELEMENTS:
            end += 1
        _attend_group(
            query,
            kv_cache,
            block_tables[start:end],
            seq_lens[start:end],
            query_start_loc[start : end + 1],
            scale,
            out,
            kv_scale,
        )
        start = end
    return out


def _attend_group(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    device = query.device
    q_start = query_start_loc[:-1].long()
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    seq_lens = seq_lens.long()
    max_q = int(q_lens.max())
    max_len = int(seq_lens.max())
    num_heads, head_dim = query.shape[1], query.shape[2]

    arange_q = torch.arange(max_q, device=device)
    rows = q_start[:, None] + arange_q[None, :]  # [B, max_q]
    valid = arange_q[None, :] < q_lens[:, None]
    q = query[rows.clamp(max=query.shape[0] - 1)].float()  # [B, max_q, Hq, D]
    q = q.transpose(1, 2)  # [B, Hq, max_q, D]

    k, v = gather_kv(kv_cache, block_tables, max_len)
    k, v = k.float(), v.float()
    if kv_scale is not None:  # fp8: stored x scale (exact: powers of two)
        k, v = k * kv_scale[0][None, :, None, None], v * kv_scale[1][None, :, None, None]

    q_pos = seq_lens[:, None] - q_lens[:, None] + arange_q[None, :]  # [B, max_q]
    k_pos = torch.arange(max_len, device=device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=k.shape[1] != num_heads
    )  # [B, Hq, max_q, D]
    o = o.transpose(1, 2)  # [B, max_q, Hq, D]
    out[rows[valid]] = o[valid].to(out.dtype).reshape(-1, num_heads, head_dim)


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks ``src[i] -> dst[i]`` (K and V): the copy-on-write primitive."""
    kv_cache[:, dst.long()] = kv_cache[:, src.long()]


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks ``block_ids`` (K and V) as a contiguous ``[2, n, num_kv_heads, block_size, head_dim]`` tensor:
    the device side of a swap-out (one contiguous copy to CPU instead of one per block)."""
    blocks = kv_cache[:, torch.as_tensor(block_ids, device=kv_cache.device).long()]
    if out is None:
        return blocks.contiguous()
    out.copy_(blocks)
    return out


def scatter_blocks(kv_cache: torch.Tensor, src: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Write ``src[:, i]`` into block ``block_ids[i]`` (K and V): the device side of a swap-in."""
    kv_cache[:, torch.as_tensor(block_ids, device=kv_cache.device).long()] = src.to(kv_cache.device, kv_cache.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of ``x`` (or of ``x + residual``, rounded to x's dtype first, as HF adds); returns
    (normed, the new residual or None).  Float32 statistics, as the HF Llama/Qwen reference."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype), residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding (the form HF Llama/Qwen checkpoints are stored for) of q
    ``[T, Hq, D]`` and k ``[T, Hk, D]``; ``cos``/``sin`` are ``[positions, D/2]`` float32 tables."""
    c = torch.cat([cos[positions]] * 2, dim=-1)[:, None, :]  # [T, 1, D]
    s = torch.cat([sin[positions]] * 2, dim=-1)[:, None, :]
    return _rotate(q, c, s), _rotate(k, c, s)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rotate_rows(x, cos.to(x.dtype), sin.to(x.dtype))


def rotate_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H, D]`` rotated by full-width ``cos``/``sin`` rows ``[T, 1, D]`` already in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
