"""Fresh prompt chunks through a dense causal attention kernel, over the K/V the step just computed.

A chunk that starts at position 0 (no earlier chunk, no prefix-cache hit) attends only to itself, and its keys and
values were produced by this very step's projection: they sit contiguously in the layer's output, so the block tables
are not needed to read them.  Such chunks run on torch's fused SDPA, which on Hopper means cuDNN's attention, faster
than the paged Triton kernel for long chunks (docs/decisions/dense-prefill.md).  torch's FlashAttention-2 backend was
slower than the Triton kernel there, so on CUDA only cuDNN is used, and only where a probe at start-up shows that it
takes the engine's tensor layout and matches the math backend; otherwise the paged kernel keeps every chunk.  cuDNN
plans each new shape (40-80 ms), so on CUDA only the lengths whose shapes were planned at start-up take this path
(kernels/triton_backend.py says which, and why padding to them does not pay). On the CPU the fused kernel is the CPU
backend's own choice, and taking the fresh K/V saves gathering the chunk back out of the cache.

Chunks with cached context before them stay on the paged kernels, which beat cuDNN there (cuDNN needs a
dense lower-right bias for them).  An fp8 cache never takes this path: the paged kernels read the
quantized values, and the fresh ones would give slightly different (unquantized) attention than the
CPU reference computes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DenseRun:
    """`num_seqs` consecutive sequences of `q_len` tokens each, whose query rows start at `row`."""

    row: int
    num_seqs: int
    q_len: int


@dataclass(frozen=True)
class DenseChunks:
    """The fresh chunks of a step.  The runner lists them after every other sequence, grouped by length
    (one fused call per group), so that the paged kernels cover a contiguous range of sequences."""

    runs: tuple[DenseRun, ...]
    num_seqs: int  # the step's last `num_seqs` sequences are these
    paged_max_query_len: int  # the longest chunk among the other (paged) sequences: the paged grid


def runs_of(lengths: list[int], first_row: int) -> tuple[DenseRun, ...]:
    """Consecutive equal lengths as one run each (the caller sorts them, so equal lengths are adjacent)."""
    runs: list[DenseRun] = []
    row = first_row
    for n in lengths:
        last = runs[-1] if runs else None
        if last is not None and last.q_len == n:
            runs[-1] = DenseRun(last.row, last.num_seqs + 1, n)
        else:
            runs.append(DenseRun(row, 1, n))
        row += n
    return tuple(runs)


def bucket_length(length: int, least: int) -> int:
    """The smallest of least x 2^k and 1.5 x least x 2^k that holds `length`: lengths grow by at most 1.5x, and
    the lengths up to n tokens fall in about 2 log2(n / least) buckets."""
    size = least
    while True:
        if length <= size:
            return size
        if length <= size * 3 // 2:
            return size * 3 // 2
        size *= 2


def batch_pieces(num_seqs: int) -> list[int]:
    """`num_seqs` as powers of two, largest first (3 -> [2, 1]): the batch sizes a dense call may take."""
    return [1 << b for b in range(num_seqs.bit_length() - 1, -1, -1) if num_seqs >> b & 1]


def is_planned_length(length: int, least: int) -> bool:
    """Whether `length` is one of the bucket lengths (at least `least`) whose shapes are planned at start-up."""
    return length >= least and bucket_length(length, least) == length


def dense_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dense: DenseChunks,
    scale: float,
    out: torch.Tensor | None,
    pow2_batches: bool = False,
) -> torch.Tensor:
    """Causal attention of each fresh chunk over itself, in its rows of `out` ``[T, Hq, D]`` (returned).
    `key`/`value` ``[T, Hkv, D]`` are the step's new K/V (the rows the cache write just stored).

    `pow2_batches`: each run is split into calls of power-of-two batch sizes (3 -> 2 + 1), so that a kernel
    that plans per shape (cuDNN: 40-80 ms per new shape on an H100) sees only the shapes of `dense_shapes`
    when the runner gives it planned lengths only.  With `out` None and one call covering every row, the
    kernel's own output is returned as it is (no copy)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    with _backend(query.device):
        for run in dense.runs:
            length = run.q_len
            first = 0
            for n in batch_pieces(run.num_seqs) if pow2_batches else [run.num_seqs]:
                rows = slice(run.row + first * length, run.row + (first + n) * length)
                first += n
                q, k, v = (t[rows].unflatten(0, (n, length)) for t in (query, key, value))  # [n, L, H, D]
                o = _attend(q, k, v, scale, heads != kv_heads)
                if out is None and rows.start == 0 and rows.stop == len(query):
                    return o.reshape(len(query), heads, query.shape[2])
                if out is None:
                    out = torch.empty_like(query)
                out[rows].unflatten(0, (n, length)).copy_(o)
    assert out is not None
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool) -> torch.Tensor:
    """Causal SDPA over ``[n, L, H, D]`` views; ``[n, L, Hq, D]`` out."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=gqa
    )
    return o.transpose(1, 2)


def dense_shapes(bucket: int, max_tokens: int) -> list[tuple[int, int]]:
    """Every (power-of-two batch, planned length) a step of at most `max_tokens` tokens can hand the dense kernel."""
    shapes = []
    length = bucket_length(bucket, bucket)
    while True:
        batch = 1
        while batch == 1 or batch * length <= max_tokens:
            shapes.append((batch, length))
            batch *= 2
        if length >= max_tokens:
            return shapes
        length = bucket_length(length + 1, bucket)


def warm(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    bucket: int,
    max_tokens: int,
) -> int:
    """Run every shape of `dense_shapes` once, so that the kernel's per-shape planning happens at start-up and
    never in a step; returns how many shapes."""
    shapes = dense_shapes(bucket, max_tokens)
    for shape in shapes:
        warm_shape(dtype, num_heads, num_kv_heads, head_dim, device, shape)
    return len(shapes)


def warm_shape(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device, shape: tuple[int, int]
) -> None:
    """Run one (batch, length) of `dense_shapes` once (the kernel plans it)."""
    batch, length = shape
    with _backend(device):
        q = torch.zeros(batch, length, num_heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(batch, length, num_kv_heads, head_dim, dtype=dtype, device=device)
        _attend(q, kv, kv, head_dim**-0.5, num_heads != num_kv_heads)


def _backend(device: torch.device) -> contextlib.AbstractContextManager:
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])


_KNOWN_REFUSALS: dict[tuple[torch.dtype, int, int, int, str], str | None] = {}


def remember_cudnn_refusal(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, device: str, why: str | None
) -> None:
    """What an earlier start on the same GPU and versions found (engine/runner/probe_cache.py): the probe, whose
    first cuDNN call loads the library (about 2 s on an H100 host), is then not run at start-up."""
    _KNOWN_REFUSALS[(dtype, num_heads, num_kv_heads, head_dim, device)] = why


def cudnn_refusal(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, device: str) -> str | None:
    """Why cuDNN's attention cannot serve fresh chunks of this shape here (None: it can); probed once per
    process unless an earlier start's answer was remembered."""
    key = (dtype, num_heads, num_kv_heads, head_dim, device)
    if key not in _KNOWN_REFUSALS:
        _KNOWN_REFUSALS[key] = _probe_cudnn(*key)
    return _KNOWN_REFUSALS[key]


def _probe_cudnn(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, device: str) -> str | None:
    """Why cuDNN's attention cannot serve fresh chunks of this shape here (None: it can).

    Runs it once on the engine's layout (q, k, v as strided views of one fused projection output) and
    compares with torch's math backend, so that a cuDNN that refuses, or silently mishandles, the
    strides or the grouped heads leaves the chunks on the paged kernel instead of failing mid-serving."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        t = 80
        g = torch.Generator(device=device).manual_seed(0)
        fused = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, generator=g, device=device).to(dtype)
        q, k, v = fused.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = q.view(t, num_heads, head_dim)
        k, v = k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)
        dense = DenseChunks(runs_of([32, 48], 0), 2, 0)
        out = dense_prefill(q, k, v, dense, head_dim**-0.5, None, pow2_batches=True)
        expected = torch.empty_like(q)
        with sdpa_kernel([SDPBackend.MATH]):
            for run in dense.runs:
                rows = slice(run.row, run.row + run.q_len)
                qq, kk, vv = (x[rows].float().transpose(0, 1)[None] for x in (q, k, v))
                kk, vv = (x.repeat_interleave(num_heads // num_kv_heads, 1) for x in (kk, vv))
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=head_dim**-0.5)
                expected[rows] = o[0].transpose(0, 1).to(dtype)
        err = float((out.float() - expected.float()).norm() / expected.float().norm())
        if not err < 2e-2:
            return f"cuDNN attention differs from the math backend by {err:.2e}"
    except Exception as e:  # noqa: BLE001 - any refusal (no cuDNN, unsupported dtype/head dim/strides)
        return (str(e).splitlines() or [type(e).__name__])[0][:200]
    return None


__all__ = [
    "DenseRun",
    "DenseChunks",
    "runs_of",
    "bucket_length",
    "batch_pieces",
    "is_planned_length",
    "remember_cudnn_refusal",
    "warm_shape",
    "dense_prefill",
    "dense_shapes",
    "warm",
    "cudnn_refusal",
]
