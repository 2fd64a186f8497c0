"""The Triton backend: the same functions as kernels/reference.py, running the Triton kernels.

``paged_attention`` picks the decode kernel when every sequence has one query token
(``max_query_len == 1``) and the prefill/extend kernel otherwise.  Nothing here synchronises with
the device: the lengths the launch needs (``max_query_len``, ``max_seq_len``) arrive as Python ints,
everything else stays in tensors read by the kernels.
"""

from __future__ import annotations

import contextlib

import torch

from kernels.cache_ops import copy_blocks, gather_blocks, scatter_blocks, write_kv
from kernels.paged_attention import paged_attention_decode, paged_attention_prefill

__all__ = ["write_kv", "paged_attention", "copy_blocks", "gather_blocks", "scatter_blocks"]


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
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its paged context; ``[T, Hq, D]`` out."""
    with _on_device(query):
        if max_query_len == 1 and query.shape[0] == seq_lens.shape[0]:
            return paged_attention_decode(query, kv_cache, block_tables, seq_lens, scale, max_seq_len, out=out)
        return paged_attention_prefill(query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                                       max_query_len, out=out)
