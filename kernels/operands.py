"""What every quantized matmul entry does to its operands first: x as 2-D rows, the AWQ tensors checked against it.

One place, so that the kernels of one format refuse the same misfit in the same words."""

from __future__ import annotations

import torch


def rows(x: torch.Tensor) -> torch.Tensor:
    """`x` ``[..., K]`` as ``[M, K]`` rows with a unit last stride (a copy only where it had none)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def awq_dims(
    x2: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> tuple[int, int, int]:
    """(M, K, N) of x2 ``[M, K]`` times AutoAWQ's GEMM-packed weight (qweight int32 ``[K, N / 8]``, qzeros int32
    ``[K / group, N / 8]``, scales ``[K / group, N]``); ValueError where the tensors do not fit x."""
    m, k = x2.shape
    n = scales.shape[1]
    if qweight.shape != (k, n // 8) or qzeros.shape != (k // group_size, n // 8):
        raise ValueError(f"AWQ tensors {tuple(qweight.shape)}/{tuple(qzeros.shape)} do not fit x [*, {k}] -> {n}")
    return m, k, n
