"""The Triton backend: the same functions as kernels/reference.py, running the Triton kernels.

``paged_attention`` picks the decode kernel when every sequence has one query token
(``max_query_len == 1``) and the prefill/extend kernel otherwise; a mixed step whose one-token
sequences come first runs each part on its own kernel, and fresh prompt chunks listed last run on
cuDNN's attention over the step's own K/V (kernels/dense_prefill.py).  Nothing here synchronises with
the device: the lengths the launch needs (``max_query_len``, ``max_seq_len``) arrive as Python ints,
everything else stays in tensors read by the kernels.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import structlog
import torch

from engine.logs import startup_detail
from kernels.cache_ops import copy_blocks, gather_blocks, scatter_blocks, write_kv
from kernels.dense_prefill import (
    DenseChunks,
    cudnn_refusal,
    dense_prefill,
    dense_shapes,
    is_planned_length,
    warm_shape,
)
from kernels.paged_attention import num_decode_splits, paged_attention_decode, paged_attention_prefill
from kernels.reference import kv_cache_shape

__all__ = [
    "write_kv",
    "paged_attention",
    "dense_prefill_lengths",
    "warm_dense_prefill",
    "warm_dense_prefill_steps",
    "copy_blocks",
    "gather_blocks",
    "scatter_blocks",
    "kv_cache_shape",
]

log = structlog.get_logger("pagekeeper.kernels")


def _on_device(t: torch.Tensor):
    # Triton launches on the current CUDA device; make it the tensors' one (cuda:N, N > 0).
    if t.device.type == "cuda" and t.device.index is not None and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


# Fresh chunks run on cuDNN only at the lengths whose shapes are planned at start-up: 1,024 x 2^k and
# 1.5 x 1,024 x 2^k (`is_planned_length`).  cuDNN builds an execution plan for every new shape (tens of ms each),
# padding a chunk up to a planned length costs more than cuDNN saves, and cuDNN wins from 1,024 tokens, where its
# host time per call hides behind the step's GEMMs (docs/decisions/dense-prefill.md).
DENSE_PREFILL_MIN_TOKENS = 1024


def dense_prefill_lengths(
    dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> Callable[[int], bool] | None:
    """Which fresh chunk lengths (no context before them) run on cuDNN's attention over the step's own K/V
    instead of the paged kernel (kernels/dense_prefill.py); None where cuDNN cannot take this model: a float32
    model, an fp8 cache, or a cuDNN that fails the start-up probe (logged once)."""
    if dtype not in (torch.float16, torch.bfloat16) or kv_dtype != dtype:
        return None
    why = cudnn_refusal(dtype, num_heads, num_kv_heads, head_dim, str(device))
    if why is not None:
        startup_detail(log, "dense_prefill_off", reason=why)
        return None
    return functools.partial(_planned_and_warm, (dtype, num_heads, num_kv_heads, head_dim, str(device)))


# Shapes whose cuDNN plans `warm_dense_prefill` made: until then (the server plans them after it starts serving,
# engine/runner/deferred.py) every chunk stays on the paged kernel, which plans nothing.
_WARMED: set[tuple[torch.dtype, int, int, int, str]] = set()


def _planned_and_warm(key: tuple[torch.dtype, int, int, int, str], length: int) -> bool:
    return key in _WARMED and is_planned_length(length, DENSE_PREFILL_MIN_TOKENS)


def warm_dense_prefill(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device, max_tokens: int
) -> int:
    """Plan every shape a step of at most `max_tokens` tokens can give cuDNN; returns how many."""
    return sum(1 for _ in warm_dense_prefill_steps(dtype, num_heads, num_kv_heads, head_dim, device, max_tokens))


def warm_dense_prefill_steps(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device, max_tokens: int
) -> Iterator[None]:
    """`warm_dense_prefill` one shape per step of the iteration; chunks go to cuDNN once every shape is planned."""
    for shape in dense_shapes(DENSE_PREFILL_MIN_TOKENS, max_tokens):
        with _on_device(torch.empty(0, device=device)):
            warm_shape(dtype, num_heads, num_kv_heads, head_dim, device, shape)
        yield
    _WARMED.add((dtype, num_heads, num_kv_heads, head_dim, str(device)))


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
    `kv_scale`: an fp8 cache's per-head scales (kernels/reference.py has the format).

    A mixed step (decodes batched with prefill chunks) lists its `num_decodes` one-token sequences
    first: they go to the decode kernel, the rest to the prefill kernel.  In the prefill kernel a
    one-query sequence would fill only one row of each ``BLOCK_M``-row tile, wasting over 99% of
    its tensor-core work over the whole context (the H200 profile of a 256 x 512 prompt burst: 10.8%
    of GPU time in prefill attention, most of it on the decode rows of mixed steps).  `dense`: the
    step's fresh chunks, listed last, which cuDNN computes from `fresh_kv` (the step's new K/V).
    """
    with _on_device(query):
        batch = seq_lens.shape[0]
        if max_query_len == 1 and query.shape[0] == batch:
            return paged_attention_decode(
                query, kv_cache, block_tables, seq_lens, scale, max_seq_len, out=out, kv_scale=kv_scale
            )
        paged_end = batch - (dense.num_seqs if dense is not None else 0)
        if dense is not None:
            if fresh_kv is None or kv_scale is not None:
                raise ValueError("dense (fresh) chunks need the step's K/V (fresh_kv) and a 16-bit cache")
            if paged_end == 0:  # a step of fresh chunks only: the dense kernel's output may be used as it is
                return dense_prefill(query, *fresh_kv, dense, scale, out, pow2_batches=True)
        if out is None:
            out = torch.empty_like(query)
        d = num_decodes  # rows 0..d-1 are the decodes' queries; the slices below keep aligned bases
        if d:
            # Long contexts split as in a decode step: with the piecewise graphs (engine/runner/piecewise.py) the
            # host is ahead of the device again, so the combine kernel pays (docs/decisions/decode-split-k.md).
            splits = num_decode_splits(d, kv_cache.shape[2], max_seq_len, query.device)
            paged_attention_decode(
                query[:d],
                kv_cache,
                block_tables[:d],
                seq_lens[:d],
                scale,
                max_seq_len,
                out=out[:d],
                num_splits=splits,
                kv_scale=kv_scale,
            )
        if d < paged_end:
            paged_attention_prefill(
                query,
                kv_cache,
                block_tables,
                seq_lens,
                query_start_loc,
                scale,
                dense.paged_max_query_len if dense is not None else max_query_len,
                out=out,
                first_seq=d,
                num_seqs=paged_end - d,
                kv_scale=kv_scale,
            )
        if dense is not None:
            assert fresh_kv is not None
            dense_prefill(query, *fresh_kv, dense, scale, out, pow2_batches=True)
        return out
