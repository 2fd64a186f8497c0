"""Linear layers of few rows on the CPU: kernels/csrc/cpu_linear.cpp's product over a panel-packed float32 weight.

A decode step reads every weight of the model for one to a few rows; oneDNN's packed product, which the CPU's
linear layers use (engine/model/cpu_packing.py), reads it below stream speed there and adds tens of microseconds a
call.  This product reads the weight once at stream speed.  It is measured only on AVX-512 hosts
(docs/decisions/cpu-linear.md), so it is offered only there; elsewhere `available()` is False and the layers keep
oneDNN's product alone.
"""

from __future__ import annotations

import torch

from kernels import cpu_ext
from kernels.operands import rows

PANEL = 32  # output features per panel (kernels/csrc/cpu_linear.cpp's kPanel)
ENV = "PAGEKEEPER_CPU_DECODE_WEIGHTS"  # auto: a second, panel-packed copy of float32 linear weights; off: none
MODES = ("auto", "off")


def mode() -> str:
    """PAGEKEEPER_CPU_DECODE_WEIGHTS, checked."""
    return cpu_ext.env_choice(ENV, MODES)


def available() -> bool:
    """The compiled product is loaded, this host is one it was measured on (AVX-512), and it is not turned off."""
    return mode() == "auto" and torch.backends.cpu.get_cpu_capability().startswith("AVX512") and cpu_ext.available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W ``[N, K]`` float32 as panels ``[ceil(N / 32), K, 32]``, zeros past N (a new tensor: W is not kept)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for x ``[..., K]`` float32 over `pack(W)`; `n` is W's row count."""
    out: torch.Tensor = torch.ops.pagekeeper_cpu.packed_linear(rows(x), panels, n, bias)
    return out.view(*x.shape[:-1], n)
