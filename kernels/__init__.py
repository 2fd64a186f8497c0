"""Attention and cache kernels: Triton on CUDA, the torch reference elsewhere, one interface."""

from __future__ import annotations

import warnings
from types import ModuleType

import torch


def attention_backend(device: torch.device | str) -> ModuleType:
    """The module providing write_kv/paged_attention/copy_blocks for tensors on `device`.

    CUDA: `kernels.triton_backend` (the Triton kernels); anything else: `kernels.cpu_backend` (torch,
    the reference with a faster decode path); CUDA without Triton installed: `kernels.reference`.
    """
    if torch.device(device).type == "cuda":
        try:
            from kernels import triton_backend
        except ImportError as e:  # pragma: no cover - depends on the installation
            warnings.warn(
                f"Triton is not available ({e}); attention runs on the slow torch reference path",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            return triton_backend
        from kernels import reference

        return reference
    from kernels import cpu_backend

    return cpu_backend


def fused_backend(device: torch.device | str) -> ModuleType:
    """The module providing rms_norm/silu_mul/rotary: the fused Triton kernels on CUDA, the compiled CPU operations
    on the CPU (`kernels.cpu_fused`, which falls back to the reference where its extension is not built), else the
    reference."""
    kind = torch.device(device).type
    if kind == "cuda":
        try:
            from kernels import fused_ops as triton_fused
        except ImportError:  # pragma: no cover - depends on the installation
            pass
        else:
            return triton_fused
    if kind == "cpu":
        from kernels import cpu_fused

        return cpu_fused
    from kernels import reference

    return reference


def quant_backend(device: torch.device | str) -> ModuleType:
    """The module providing fp8_linear/awq_linear: `kernels.quant_cuda` (torch._scaled_mm, the Triton AWQ
    GEMM) on CUDA, `kernels.quant_reference` (dequantize, then a torch matmul) elsewhere."""
    if torch.device(device).type == "cuda":
        from kernels import quant_cuda

        return quant_cuda
    from kernels import quant_reference

    return quant_reference
