"""The decoder layer's small operations on the CPU: kernels/reference.py's interface, one compiled pass each.

RMSNorm (with the residual add), SiLU-and-multiply and rotary run as kernels/csrc/cpu_fused.cpp's operations when
the CPU extension is loaded (kernels/cpu_ext.py), and as the torch reference otherwise or for inputs the compiled
ones do not take (a weight in another dtype than the activations, float64).  In torch each is five to ten
dispatched operations; on a step of a few sequences the dispatches cost more than the arithmetic
(docs/decisions/cpu-fused-ops.md).  The compiled operations round where the reference rounds; only the RMS's float32
sum is ordered differently.
"""

from __future__ import annotations

import torch

from kernels import cpu_ext, reference
from kernels.operands import rows

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _compiled(x: torch.Tensor) -> bool:
    return x.dtype in _DTYPES and x.device.type == "cpu" and cpu_ext.available()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of ``x`` (or of ``x + residual``, rounded to x's dtype first); returns (normed, the new residual or
    None), as kernels/reference.py's."""
    if not _compiled(x) or weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        return reference.rms_norm(x, weight, eps, residual)
    shape = x.shape
    w = weight if weight.is_contiguous() else weight.contiguous()
    if residual is None:
        return torch.ops.pagekeeper_cpu.rms_norm(rows(x), w, eps).view(shape), None
    normed, total = torch.ops.pagekeeper_cpu.add_rms_norm(rows(x), rows(residual), w, eps)
    return normed.view(shape), total.view(shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension."""
    if not _compiled(gate_up):
        return reference.silu_mul(gate_up)
    out = torch.ops.pagekeeper_cpu.silu_mul(rows(gate_up))
    return out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of q ``[T, Hq, D]`` and k ``[T, Hk, D]``; ``cos``/``sin`` are ``[positions,
    D/2]`` float32 tables.  Compiled, q and k are rotated in place (strided views of the fused QKV projection are
    fine, as on CUDA) and returned."""
    if not (_compiled(q) and handles_rotary(q, k, cos, sin)):
        return reference.rotary(q, k, positions, cos, sin)
    torch.ops.pagekeeper_cpu.rotary(q, k, positions.long().contiguous(), cos, sin)
    return q, k


def handles_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The compiled rotary takes these operands as they are (else the caller's torch path runs)."""
    return (
        q.dtype in _DTYPES
        and k.dtype == q.dtype
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and cos.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cpu_ext.available()
    )


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Copy key/value ``[T, H, D]`` rows into an NHD cache ``[2, blocks, block_size, H, D]`` of their own dtype at
    ``slot_mapping`` (-1: skipped); False (nothing written) where the compiled copy does not apply, so that the
    caller's torch path runs."""
    if not (
        key.dtype == kv_cache.dtype == value.dtype
        and key.dtype in _DTYPES
        and kv_cache.is_contiguous()
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and key.stride(1) == key.shape[2]
        and value.stride(1) == value.shape[2]
        and slot_mapping.dtype in (torch.int32, torch.int64)
        and cpu_ext.available()
    ):
        return False
    torch.ops.pagekeeper_cpu.write_kv(key, value, kv_cache, slot_mapping.contiguous())
    return True
