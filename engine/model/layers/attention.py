"""The attention layer over paged KV: writes this step's K/V into their slots, then attends.

The layer does not know which kernels run: `kernels.attention_backend(device)` picks the Triton
kernels on CUDA and the torch reference elsewhere, behind the same two functions.

With an FP8 KV cache (the runner allocates it as float8_e4m3fn) the layer hands the kernels its
`kv_scale` ``[2, num_kv_heads]``: one power-of-two scale per K/V and KV head, set at start-up by
engine/runner/kv_scales.py from the largest values a calibration pass wrote (`kv_amax`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from kernels.dense_prefill import DenseChunks


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
    # Fresh prompt chunks (no context before them) listed last, which the backend computes from the
    # step's own K/V instead of the paged cache (kernels/dense_prefill.py); None: every chunk is paged.
    dense: DenseChunks | None = None


class PagedAttention(nn.Module):
    kv_scale: torch.Tensor  # a buffer: [2, num_kv_heads] float32

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend: ModuleType | None = None  # set by the model runner
        # The FP8 cache's scales (unused by a 16/32-bit cache); not in the checkpoint, so not persistent.
        self.register_buffer("kv_scale", torch.ones(2, num_kv_heads, dtype=torch.float32), persistent=False)
        # While calibrating: the largest |k| and |v| written so far, per KV head (else None).
        self.kv_amax: torch.Tensor | None = None

    def finish_load(self) -> None:
        """Scales of 1 until calibration sets them (the model is built on the meta device, so the buffer
        holds whatever memory it was given)."""
        with torch.no_grad():
            self.kv_scale.fill_(1.0)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self.write(k, v, kv_cache, meta.slot_mapping)
        return self.attend(q, k, v, kv_cache, meta)

    def write(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store this step's K/V in their slots (slot -1: a padding row, not stored).  Apart from `attend`
        because a piecewise CUDA graph captures the write (its tensors keep their addresses) but not the
        attention (its launch depends on the step's sequences)."""
        if self.kv_amax is not None:
            seen = torch.stack([k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))]).float()
            self.kv_amax = torch.maximum(self.kv_amax, seen)
        self._backend().write_kv(k, v, kv_cache, slot_mapping, self._kv_scale(kv_cache))

    def _backend(self) -> ModuleType:
        assert self.backend is not None, "the model runner sets the attention backend before the first step"
        return self.backend

    def _kv_scale(self, kv_cache: torch.Tensor) -> torch.Tensor | None:
        return self.kv_scale if kv_cache.dtype == torch.float8_e4m3fn else None

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of `q` over the cache (`write` has stored this step's K/V); `out`: where to write it,
        which the result may or may not be (a step of fresh chunks only may return the dense kernel's own)."""
        kv_scale = self._kv_scale(kv_cache)
        # fresh chunks (listed last) attend over this step's own K/V on the backend's dense kernel
        extra: dict[str, object] = {} if meta.dense is None else {"dense": meta.dense, "fresh_kv": (k, v)}
        if out is not None:
            extra["out"] = out
        return self._backend().paged_attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            meta.max_query_len,
            meta.max_seq_len,
            num_decodes=meta.num_decodes,
            kv_scale=kv_scale,
            **extra,
        )
