"""The CPU backend's decode path against the torch reference: plain decode, grouped-query heads,
sequences of different lengths (padded tables), mixed steps (decodes first, then prefill chunks),
bfloat16 caches; and the engine picks it on the CPU."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_backend, reference


def _case(batch: int, heads: int, kv_heads: int, block_size: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    head_dim = 32
    lens = torch.randint(1, 70, (batch,), generator=g).int()
    per_seq = [-(-int(n) // block_size) for n in lens]
    num_blocks = sum(per_seq) + 5
    cache = torch.randn(2, num_blocks, kv_heads, block_size, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g)
    width = max(per_seq) + 2
    tables = torch.zeros(batch, width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used : used + n]
        used += n
    return cache, tables, lens


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_the_reference(heads, kv_heads, block_size, dtype):
    cache, tables, lens = _case(7, heads, kv_heads, block_size, dtype, seed=block_size + heads)
    q = torch.randn(7, heads, 32).to(dtype)
    qsl = torch.arange(8, dtype=torch.int32)
    want = reference.paged_attention(q, cache, tables, lens, qsl, 0.17, 1, int(lens.max()))
    got = cpu_backend.paged_attention(q, cache, tables, lens, qsl, 0.17, 1, int(lens.max()))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_mixed_step_equals_the_reference():
    cache, tables, lens = _case(6, 8, 2, 16, torch.float32, seed=3)
    q_lens = [1, 1, 1, 5, 12, 1]  # three decodes first, then two prefill chunks, then ... a chunk of 1
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    lens = torch.maximum(lens, torch.tensor(q_lens, dtype=torch.int32))
    q = torch.randn(int(qsl[-1]), 8, 32)
    want = reference.paged_attention(q, cache, tables, lens, qsl, 0.2, 12, int(lens.max()))
    got = cpu_backend.paged_attention(q, cache, tables, lens, qsl, 0.2, 12, int(lens.max()), num_decodes=3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_engine_uses_it_on_the_cpu():
    assert kernels.attention_backend("cpu") is cpu_backend
