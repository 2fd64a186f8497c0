"""Random AWQ weights for the kernel tests: int4 values, zero points and float16-representable scales, packed as
AutoAWQ's GEMM layout (kernels/quant_reference.py), on the tests' device."""

from __future__ import annotations

import torch

from kernels import quant_reference as qr

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_awq(
    k: int, n: int, group: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q ``[K, N]`` int values 0..15 on the CPU, qweight, qzeros, scales in `dtype`): scales are float16 values,
    so that every activation dtype sees the same weight."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(0, 16, (k // group, n), generator=g)
    s = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).half().to(dtype)
    return q, qr.pack_int4(q).to(DEVICE), qr.pack_int4(z).to(DEVICE), s.to(DEVICE)
