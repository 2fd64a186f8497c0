"""What the loader, the runner and the workers use of a model, whatever its architecture.

Every architecture in engine/model/registry.py is a `CausalLM`: its KV cache geometry on this rank, its
forward, its logits and its checkpoint loading.  The Llama family is also a `PiecewiseLM`: its forward split
at each attention, which engine/runner/piecewise.py captures as one CUDA graph per piece.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from engine.model.layers.attention import AttentionMetadata, PagedAttention
from engine.model.weights import CheckpointTensor


class CausalLM(nn.Module):
    """A decoder-only model over a paged KV cache (one cache tensor per layer)."""

    # KV cache geometry on this rank: the runner sizes and shapes the cache with it
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """The final hidden states ``[T, hidden]`` of this step's tokens."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, vocab]`` on every rank."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]) -> None:
        """Fill the model from checkpoint tensors by name (engine/model/weights.py)."""
        raise NotImplementedError


class PiecewiseLM(CausalLM):
    """A model whose forward is also offered in pieces split at each attention (`forward` is the same sequence)."""

    hidden_size: int

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def before_attention(
        self, layer: int, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v, residual) of layer `layer`, from the previous layer's output and residual (None: the first)."""
        raise NotImplementedError

    def attention(self, layer: int) -> PagedAttention:
        raise NotImplementedError

    def after_attention(self, layer: int, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer output, residual) from the attention's output ``[T, Hq, D]``."""
        raise NotImplementedError

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError
