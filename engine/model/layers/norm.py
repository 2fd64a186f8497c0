"""RMSNorm computed in float32 and cast back, exactly as the HF Llama/Qwen reference does.

On CUDA it runs as one fused Triton kernel (kernels/fused_ops.py), with the residual add of the
decoder layer folded in (`add_norm`); elsewhere as the torch reference (kernels/reference.py).
"""

from __future__ import annotations

import torch
from torch import nn

import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.fused_backend(x.device).rms_norm(x, self.weight, self.eps)[0]

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); with no residual yet (the first layer), (norm(x), x)."""
        if residual is None:
            return self.forward(x), x
        normed, new_residual = kernels.fused_backend(x.device).rms_norm(x, self.weight, self.eps, residual)
        assert new_residual is not None
        return normed, new_residual
