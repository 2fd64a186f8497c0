"""The attention layer over paged KV: writes this step's K/V into their slots, then attends.

The layer does not know which kernels run: `kernels.attention_backend(device)` picks the Triton
kernels on CUDA and the torch reference elsewhere, behind the same two functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer (see kernels/reference.py for their meaning)."""

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    # Mixed steps list their one-token (decode) sequences first: how many (the GPU backend runs
    # them on the decode kernel and the rest on the prefill kernel).
    num_decodes: int = 0


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend: ModuleType | None = None  # set by the model runner

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        backend = self.backend
        assert backend is not None, "the model runner sets the attention backend before the first step"
        backend.write_kv(k, v, kv_cache, meta.slot_mapping)
        return backend.paged_attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            meta.max_query_len,
            meta.max_seq_len,
            num_decodes=meta.num_decodes,
        )
