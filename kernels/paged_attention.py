"""Triton paged attention: decode (one query per sequence, split-K) and prefill/extend (causal chunks).

Both kernels read K/V straight out of the paged cache ``[2, num_blocks, num_kv_heads, block_size,
head_dim]`` through the block tables (see kernels/reference.py for the metadata's meaning); no
contiguous copy of the context is ever made.

Decode: one program per (sequence, KV head, split).  The program packs the query heads that share
the KV head (the GQA group) into the rows of one ``tl.dot`` so each K/V tile is read from memory
once for the whole group.  A tile spans ``BLOCK_N`` tokens, i.e. several cache blocks; their block
ids are gathered from the block table inside the loop.  When the batch is too small to fill the GPU
the context is split ("flash decoding"): each split writes its normalised partial output and
log-sum-exp and a second kernel combines them.

Prefill/extend: one program per (query head, tile of ``BLOCK_M`` query rows, sequence), variable
lengths in one launch.  Keys before the tile's first query position need no causal mask and are
walked in an unmasked loop; only the diagonal band is masked.  Heavy (late) tiles are launched first.

FP8 KV cache (kernels/reference.py has the format): K/V tiles are loaded as float8_e4m3fn and
widened in registers to the query's dtype (exact: every e4m3 value is a bf16/fp16 value), so the
tensor-core dots run as for a 16-bit cache while half the bytes are read.  The head's power-of-two
scales are applied once per program, not per element: the key scale folds into the score scale,
the value scale multiplies the normalised output.

Nothing here depends on sequence lengths at compile time: lengths come from tensors, the split
size is a runtime argument that is never specialised, and tile sizes come from a small table keyed
on head dim, block size and dtype.  Softmax runs in float32 (exp2 with log2(e) folded into the
scale); float32 caches use IEEE dot products so the fp32 engine matches the torch reference.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.cache_ops import _cdiv, _next_pow2
from kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_one_row

LOG2E = 1.4426950408889634
FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    # DOT_UPCAST: Triton's CPU interpreter multiplies bfloat16 tiles as their raw uint16 bits, so under
    # the interpreter bf16 operands are widened first (exact: a bf16 product fits float32, which is
    # what the tensor cores accumulate in).  Never set on a GPU.
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _online_softmax_step(
    m_i,
    l_i,
    acc,
    s,
    v,
    M_FLOOR: tl.constexpr,
    PV_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """One step of the streaming (online) softmax: fold a tile of scores into the running state.

    ``s`` ``[R, N]`` are scores in log2 units (masked entries -inf), ``v`` ``[N, D]`` their values;
    the state is the running max ``m_i`` ``[R]``, the running sum of exponentials ``l_i`` ``[R]`` and
    the unnormalised output ``acc`` ``[R, D]`` (float32).  Returns the new ``(m_i, l_i, acc)``.

    M_FLOOR: clamp the max to -1e30, so that a row that has seen only masked scores keeps a finite
    max and never forms NaN (-inf - -inf).  PV_DOT: ``p @ v`` as a tensor-core dot; otherwise
    ``N == 1`` and ``p * v`` broadcasts (the split combine, where the "values" are partial outputs).
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if M_FLOOR:
        m_new = tl.maximum(m_new, -1.0e30)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if PV_DOT:
        pv = _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    else:
        pv = p * v
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _fp16_scaled_query(q, qk_scale):
    """An fp8 cache read by a bfloat16 model: the dots run in float16 instead.  e4m3 widens to float16 in
    one instruction per pair on Hopper, to bfloat16 only through float32 (the H100 run of the decode kernel
    at batch 64 x 4,096: 55 % of copy bandwidth with bfloat16 dots, against 97 % for a bfloat16 cache), and
    float16 keeps more of every operand's bits.  The query is scaled first (the softmax scale and the key
    scale, in float32), so that no query element can overflow float16's range; the scores then need no
    further scale."""
    return (q.to(tl.float32) * qk_scale).to(tl.float16), 1.0


# Arguments that vary with the batch's lengths are never specialised (Triton would otherwise compile
# variants for values equal to 1 or divisible by 16): the block-table width, the split geometry.
@triton.jit(do_not_specialize=["stride_bt", "stride_pb", "stride_ph", "tokens_per_split"])
def _decode_kernel(
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    kv_scale_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_cs,
    stride_bt,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_sc,
    tokens_per_split,
    QUERY_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP16_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # kernels/pdl.py: the combine (or the product) may launch now; this kernel itself is launched plainly
        gdc_launch_dependents()

    offs_g = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kvh * QUERY_GROUP + offs_g
    mask_g = offs_g < QUERY_GROUP
    mask_d = offs_d < HEAD_DIM
    # The query is loaded before the length, not after it: the two reads are in flight together (a decode step
    # of a few sequences is a chain of dependent reads, length -> block table -> K/V, not a stream of bytes).
    q_in = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * tokens_per_split
    if start < seq_len:
        end = tl.minimum(start + tokens_per_split, seq_len)
        offs_n = tl.arange(0, BLOCK_N)
        q = q_in  # a name of this branch's own: the fp8 cache's float16 query changes its type

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        if KV_FP8:
            qk_scale = qk_scale * tl.load(kv_scale_ptr + kvh)
            if FP16_DOT:
                q, qk_scale = _fp16_scaled_query(q, qk_scale)

        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        k_base = k_ptr + kvh.to(tl.int64) * stride_ch
        v_base = v_ptr + kvh.to(tl.int64) * stride_ch
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            mask_n = pos < end
            blk = tl.load(table + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
            row = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_base + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_base + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)

            s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(
                m_i, l_i, acc, s, v, M_FLOOR=False, PV_DOT=True, DOT_PRECISION=DOT_PRECISION, DOT_UPCAST=DOT_UPCAST
            )

        o = acc / l_i[:, None]
        if KV_FP8:
            o = o * tl.load(kv_scale_ptr + stride_sc + kvh)
        if SPLIT:
            # Normalised partial output and its log2-sum-exp (scores are in log2 units).
            p_row = seq.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
            tl.store(part_o_ptr + p_row[:, None] * HEAD_DIM_PAD + offs_d[None, :], o, mask=mask_g[:, None])
            tl.store(part_lse_ptr + p_row, m_i + tl.log2(l_i), mask=mask_g)
        else:
            tl.store(
                out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=mask_g[:, None] & mask_d[None, :],
            )


@triton.jit(do_not_specialize=["stride_pb", "stride_ph", "tokens_per_split"])
def _decode_reduce_kernel(
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    stride_ot,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    tokens_per_split,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if PDL:  # kernels/pdl.py: wait for the decode kernel, then let the product launch
        gdc_wait()
        gdc_launch_dependents()
    seq_len = tl.load(seq_lens_ptr + seq)
    num_splits = tl.cdiv(seq_len, tokens_per_split)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    base = seq.to(tl.int64) * stride_pb + head * stride_ph

    # The online softmax over the splits, one "key" per step: its score is the split's log2-sum-exp,
    # its value the split's normalised output (state as one row: [1], [1], [1, HEAD_DIM_PAD]).
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    total = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([1, HEAD_DIM_PAD], dtype=tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(part_lse_ptr + base + s * stride_ps + tl.zeros([1], dtype=tl.int32))
        o = tl.load(part_o_ptr + (base + s * stride_ps) * HEAD_DIM_PAD + offs_d)
        m, total, acc = _online_softmax_step(
            m, total, acc, lse[:, None], o[None, :], M_FLOOR=False, PV_DOT=False, DOT_PRECISION="ieee", DOT_UPCAST=False
        )
    out = acc / total[:, None]
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d[None, :] < HEAD_DIM,
    )


@triton.jit(do_not_specialize=["stride_bt", "first_seq"])
def _prefill_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    kv_scale_ptr,
    qk_scale,
    first_seq,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_cs,
    stride_bt,
    stride_sc,
    QUERY_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP16_DOT: tl.constexpr,
):
    head = tl.program_id(0)
    m_tile = tl.num_programs(1) - 1 - tl.program_id(1)  # heaviest (latest) tiles first
    seq = first_seq + tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    m0 = m_tile * BLOCK_M
    if m0 < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len  # tokens before this chunk (earlier chunks, prefix-cache hits)

        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        mask_m = offs_m < q_len
        mask_d = offs_d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        q_pos = ctx + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

        kvh = head // QUERY_GROUP
        if KV_FP8:
            qk_scale = qk_scale * tl.load(kv_scale_ptr + kvh)
            if FP16_DOT:
                q, qk_scale = _fp16_scaled_query(q, qk_scale)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        k_base = k_ptr + kvh.to(tl.int64) * stride_ch
        v_base = v_ptr + kvh.to(tl.int64) * stride_ch

        # Keys strictly before the tile's first query position, in whole tiles: no mask at all.
        full_end = ((ctx + m0) // BLOCK_N) * BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            pos = n0 + offs_n
            blk = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
            row = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs
            k = tl.load(k_base + row[:, None] + offs_d[None, :], mask=mask_d[None, :], other=0.0).to(q.dtype)
            v = tl.load(v_base + row[:, None] + offs_d[None, :], mask=mask_d[None, :], other=0.0).to(q.dtype)
            s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
            m_i, l_i, acc = _online_softmax_step(
                m_i, l_i, acc, s, v, M_FLOOR=False, PV_DOT=True, DOT_PRECISION=DOT_PRECISION, DOT_UPCAST=DOT_UPCAST
            )

        # The diagonal band: causal mask and the end of the context.
        band_end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
        for n0 in range(full_end, band_end, BLOCK_N):
            pos = n0 + offs_n
            mask_n = pos < band_end
            blk = tl.load(table + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
            row = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_base + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_base + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
            visible = (pos[None, :] <= q_pos[:, None]) & mask_n[None, :]
            s = tl.where(visible, s, float("-inf"))
            # Every row sees key 0 of the band or an earlier key, except padding rows past q_len,
            # which may see nothing: M_FLOOR keeps their max finite so no NaN is ever formed.
            m_i, l_i, acc = _online_softmax_step(
                m_i, l_i, acc, s, v, M_FLOOR=True, PV_DOT=True, DOT_PRECISION=DOT_PRECISION, DOT_UPCAST=DOT_UPCAST
            )

        o = acc / l_i[:, None]
        if KV_FP8:
            o = o * tl.load(kv_scale_ptr + stride_sc + kvh)
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


# ---------------------------------------------------------------------------------------------
# tile tables and launch helpers
# ---------------------------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _dot_upcast(query: torch.Tensor) -> bool:
    return query.device.type != "cuda" and query.dtype == torch.bfloat16  # see _dot


def _pad_dim(head_dim: int) -> int:
    return max(16, _next_pow2(head_dim))


def decode_config(head_dim: int, block_size: int, dtype: torch.dtype, kv_fp8: bool = False) -> dict:
    """BLOCK_N (tokens per tile, several cache blocks), num_warps, num_stages for the decode kernel."""
    d = _pad_dim(head_dim)
    if kv_fp8 and dtype != torch.float32 and d >= 128:
        # H100 sweep (bf16 model, fp8 cache, batch 64 x 4096, block 16, float16 dots): 128/2w/2s 88.6 % of
        # copy, 128/4w/3s 79 %, 64/4w/3s 58 %: half the bytes per token want twice the tokens per tile
        return dict(BLOCK_N=128, num_warps=2, num_stages=2)
    if dtype == torch.float32:
        return dict(BLOCK_N=32 if d >= 128 else 64, num_warps=4, num_stages=2)
    if d <= 64:
        return dict(BLOCK_N=128, num_warps=4, num_stages=3)
    # H200 sweep (bf16, batch 64 x 4096, block 16): 64/4w/3s 97.3% of copy; 128/4w 81%, 32/4w 91%
    return dict(BLOCK_N=64, num_warps=4, num_stages=3)


def prefill_config(head_dim: int, block_size: int, dtype: torch.dtype) -> dict:
    d = _pad_dim(head_dim)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    if d <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    # H200 sweep (bf16, 4 x 2048 causal): 128/32/4w/3s 0.439 ms < 64/64/4/3 0.448 < 128/64/8/3 0.482
    return dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3)


# A chunk whose grid of 128-row tiles would not fill two waves of the GPU (a 512-token chunk of one sequence
# after a long cached prefix: 32 heads x 4 tiles = 128 programs on the H100's 132 SMs, each streaming the
# whole context) runs 64-row tiles: twice the programs, half the serial work each.
SMALL_GRID_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small, so that tests exercise the split path


# A split should still stream a useful amount of context, or the combine step costs more than it saves: one tile of
# BLOCK_N tokens.  A program's tiles are a chain of dependent reads and dots, so a batch of a few sequences finishes
# sooner on one-tile splits and the second kernel's combine than on four-tile ones (docs/decisions/decode-split-k.md).
MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 64


# A serving batch mixes a few long contexts with many short ones, and with one program per (sequence, KV head) the step
# waits on the programs of its longest sequences long after the short ones are done.  Contexts that may be 1,024 tokens
# or longer are split into pieces of about this many tokens however large the batch (a sequence shorter than a split's
# start leaves that program empty); uniform long contexts pay a little for the combine
# (docs/decisions/decode-split-k.md).  Graphs are captured with max_model_len as the longest context, so that, not the
# step's, sets their split.
LONG_CONTEXT_SPLIT_TOKENS = 512


def num_decode_splits(
    batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device, split_long: bool = True
) -> int:
    """How many splits of the context: enough programs for ~2 waves when the batch alone has fewer, and (with
    `split_long`) pieces of about LONG_CONTEXT_SPLIT_TOKENS when the longest context may be long."""
    by_length = min(MAX_SPLITS, max_seq_len // LONG_CONTEXT_SPLIT_TOKENS) if split_long else 0
    programs = batch * num_kv_heads
    target = 2 * _num_sms(device)
    if programs >= target:
        return max(1, by_length)
    by_programs = min(MAX_SPLITS, -(-target // programs), -(-max_seq_len // MIN_TOKENS_PER_SPLIT))
    return max(1, by_programs, by_length)


def _check_cache(kv_cache: torch.Tensor, query: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, num_kv_heads, block_size, head_dim], got {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache's last dimension must be contiguous")
    if query.shape[-1] != kv_cache.shape[-1]:
        raise ValueError(f"query head dim {query.shape[-1]} != cache head dim {kv_cache.shape[-1]}")
    if query.shape[1] % kv_cache.shape[2]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {kv_cache.shape[2]} KV heads")
    if query.dtype != kv_cache.dtype and kv_cache.dtype != FP8:
        raise ValueError(f"query dtype {query.dtype} != kv_cache dtype {kv_cache.dtype}")


def _scales(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """(the scales an fp8 cache is read with, their row stride); (None, 0) for a 16/32-bit cache."""
    if kv_cache.dtype != FP8:
        return None, 0
    if kv_scale is None or tuple(kv_scale.shape) != (2, kv_cache.shape[2]) or kv_scale.stride(1) != 1:
        raise ValueError(f"an fp8 KV cache needs kv_scale [2, {kv_cache.shape[2]}] float32 (last dim contiguous)")
    return kv_scale, kv_scale.stride(0)


def _scratch(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The split-K partials (float32, uninitialised: the decode kernel writes every entry the combine reads)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def paged_attention_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: dict | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence (row b of ``query`` belongs to sequence b); ``[B, Hq, D]`` out."""
    _check_cache(kv_cache, query)
    scales, stride_sc = _scales(kv_cache, kv_scale)
    if query.stride(-1) != 1:
        query = query.contiguous()
    batch, num_heads, head_dim = query.shape
    if batch != seq_lens.shape[0]:
        raise ValueError(f"decode takes one query per sequence: {batch} queries for {seq_lens.shape[0]} sequences")
    _, _, num_kv_heads, block_size, _ = kv_cache.shape
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    cfg = dict(decode_config(head_dim, block_size, query.dtype, scales is not None), **(config or {}))
    block_n = cfg.pop("BLOCK_N")
    d_pad = _pad_dim(head_dim)
    if num_splits is None:
        num_splits = num_decode_splits(batch, num_kv_heads, max_seq_len, query.device)
    tokens_per_split = _cdiv(_cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    num_splits = _cdiv(max(max_seq_len, 1), tokens_per_split)
    split = num_splits > 1
    if split:
        part_o = _scratch((batch, num_heads, num_splits, d_pad), query.device)
        part_lse = _scratch((batch, num_heads, num_splits), query.device)
        p_strides = (num_heads * num_splits, num_splits, 1)
    else:
        part_o = part_lse = out  # unused
        p_strides = (0, 0, 0)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    on = pdl_one_row(query.device, batch)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        out,
        part_o,
        part_lse,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        seq_lens if scales is None else scales,  # unused without fp8
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        *p_strides,
        stride_sc,
        tokens_per_split,
        QUERY_GROUP=group,
        BLOCK_M=max(16, _next_pow2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_PRECISION=_dot_precision(query.dtype),
        DOT_UPCAST=_dot_upcast(query),
        KV_FP8=scales is not None,
        FP16_DOT=scales is not None and query.dtype == torch.bfloat16,
        PDL=on,
        **cfg,
    )
    if split:
        _decode_reduce_kernel[(batch, num_heads)](
            out,
            part_o,
            part_lse,
            seq_lens,
            out.stride(0),
            out.stride(1),
            *p_strides,
            tokens_per_split,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=d_pad,
            PDL=on,
            num_warps=4 if d_pad >= 128 else 2,
            **launch_options(on),
        )
    return out


def paged_attention_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    first_seq: int = 0,
    kv_scale: torch.Tensor | None = None,
    num_seqs: int | None = None,
) -> torch.Tensor:
    """Each sequence's chunk of queries attends causally to the chunk and all earlier paged KV.

    Only sequences `first_seq` .. `first_seq + num_seqs - 1` (default: to the end) are computed; the
    others are left alone (a mixed step's decodes, which the decode kernel serves, and its fresh chunks,
    which cuDNN serves).  An offset rather than sliced tensors: a slice of the block tables or lengths
    starts at an address Triton cannot assume 16-byte aligned, which would compile another kernel
    variant in the middle of serving.
    """
    _check_cache(kv_cache, query)
    scales, stride_sc = _scales(kv_cache, kv_scale)
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_tokens, num_heads, head_dim = query.shape
    _, _, num_kv_heads, block_size, _ = kv_cache.shape
    if out is None:
        out = torch.empty_like(query)
    batch = seq_lens.shape[0] - first_seq if num_seqs is None else num_seqs
    if num_tokens == 0 or batch <= 0:
        return out
    cfg = dict(prefill_config(head_dim, block_size, query.dtype), **(config or {}))
    if config is None and cfg["BLOCK_M"] > SMALL_GRID_CONFIG["BLOCK_M"]:
        programs = num_heads * _cdiv(max_query_len, cfg["BLOCK_M"]) * batch
        if programs < 2 * _num_sms(query.device):
            cfg = dict(SMALL_GRID_CONFIG)
    block_m = cfg.pop("BLOCK_M")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_heads, _cdiv(max_query_len, block_m), batch)
    _prefill_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        seq_lens if scales is None else scales,  # unused without fp8
        scale * LOG2E,
        first_seq,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        stride_sc,
        QUERY_GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=_pad_dim(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        DOT_PRECISION=_dot_precision(query.dtype),
        DOT_UPCAST=_dot_upcast(query),
        KV_FP8=scales is not None,
        FP16_DOT=scales is not None and query.dtype == torch.bfloat16,
        **cfg,
    )
    return out


__all__ = [
    "decode_config",
    "prefill_config",
    "SMALL_GRID_CONFIG",
    "num_decode_splits",
    "paged_attention_decode",
    "paged_attention_prefill",
]
