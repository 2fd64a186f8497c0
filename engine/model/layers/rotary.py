"""Rotary position embedding (the rotate-half form HF Llama/Qwen checkpoints are stored for).

cos/sin are precomputed in float32 for every position up to max_model_len, once, so a step only
indexes them.  Supported scalings: none, linear and Llama 3's frequency-dependent scaling; anything
else is refused at load time rather than silently producing different numbers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import kernels
from kernels import cpu_fused
from kernels.reference import rotate_rows

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any]]:
    """(theta, scaling dict) across transformers 4.x (rope_theta/rope_scaling) and 5.x (rope_parameters)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    merged = {**params, **scaling}
    theta = merged.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    merged["rope_type"] = rope_type
    return float(theta), merged


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any], device: torch.device | str
    ) -> None:
        super().__init__()
        if scaling["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling {scaling['rope_type']!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )
        inv_freq = _inv_freq(head_dim, theta, scaling).to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        self.cos = freqs.cos()  # [P, D/2], plain attributes: not part of the state dict
        self.sin = freqs.sin()
        # Off the GPU: the step's full-width cos/sin rows in the activations' dtype, made by the first layer and
        # reused by the others (every layer of a forward gets the same positions tensor).  Keyed by the tensor
        # object, which is held here so no later step's tensor can take its identity; off the GPU the runner
        # makes a new positions tensor every step (only CUDA graphs rewrite a static buffer, and CUDA does not
        # come here).
        self._step_rows: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k): one fused kernel in place on CUDA (Triton) and on the CPU (the compiled extension, where
        built), the torch reference elsewhere."""
        if q.is_cuda or (q.device.type == "cpu" and cpu_fused.handles_rotary(q, k, self.cos, self.sin)):
            return kernels.fused_backend(q.device).rotary(q, k, positions, self.cos, self.sin)
        rows = self._step_rows
        if rows is None or rows[0] is not positions or rows[1] != q.dtype:
            c = torch.cat([self.cos[positions]] * 2, dim=-1)[:, None, :].to(q.dtype)  # [T, 1, D]
            s = torch.cat([self.sin[positions]] * 2, dim=-1)[:, None, :].to(q.dtype)
            rows = self._step_rows = (positions, q.dtype, c, s)
        return rotate_rows(q, rows[2], rows[3]), rotate_rows(k, rows[2], rows[3])
