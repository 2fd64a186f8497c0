"""The Triton backend: the same functions as kernels/reference.py, running the Triton kernels.

``paged_attention`` picks the decode kernel when every sequence has one query token
(``max_query_len == 1``) and the prefill/extend kernel otherwise; a mixed step whose one-token
sequences come first runs each part on its own kernel.  Nothing here synchronises with
the device: the lengths the launch needs (``max_query_len``, ``max_seq_len``) arrive as Python ints,
everything else stays in tensors read by the kernels.
"""

from __future__ import annotations

import contextlib

import torch

from kernels.cache_ops import copy_blocks, gather_blocks, scatter_blocks, write_kv
from kernels.paged_attention import paged_attention_decode, paged_attention_prefill
from kernels.reference import kv_cache_shape

__all__ = ["write_kv", "paged_attention", "copy_blocks", "gather_blocks", "scatter_blocks", "kv_cache_shape"]


def _on_device(t: torch.Tensor):
    # Triton launches on the current CUDA device; make it the tensors' one (cuda:N, N > 0).
    if t.device.type == "cuda" and t.device.index is not None and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


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
    `kv_scale`: an fp8 cache's per-head scales (kernels/reference.py has the format).

    A mixed step (decodes batched with prefill chunks) lists its `num_decodes` one-token sequences
    first: they go to the decode kernel, the rest to the prefill kernel.  In the prefill kernel a
    one-query sequence would fill only one row of each ``BLOCK_M``-row tile, wasting over 99% of
    its tensor-core work over the whole context (the H200 profile of a 256 x 512 prompt burst: 10.8%
    of GPU time in prefill attention, most of it on the decode rows of mixed steps).
    """
    with _on_device(query):
        batch = seq_lens.shape[0]
        if max_query_len == 1 and query.shape[0] == batch:
            return paged_attention_decode(
                query, kv_cache, block_tables, seq_lens, scale, max_seq_len, out=out, kv_scale=kv_scale
            )
        if not 0 < num_decodes < batch:
            return paged_attention_prefill(
                query,
                kv_cache,
                block_tables,
                seq_lens,
                query_start_loc,
                scale,
                max_query_len,
                out=out,
                kv_scale=kv_scale,
            )
        if out is None:
            out = torch.empty_like(query)
        d = num_decodes  # rows 0..d-1 are the decodes' queries; the slices below keep aligned bases
        paged_attention_decode(
            query[:d], kv_cache, block_tables[:d], seq_lens[:d], scale, max_seq_len, out=out[:d], kv_scale=kv_scale
        )
        paged_attention_prefill(
            query,
            kv_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_query_len,
            out=out,
            first_seq=d,
            kv_scale=kv_scale,
        )
        return out
