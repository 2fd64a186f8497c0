"""The torch reference against a deliberately naive per-sequence, per-head implementation.

The reference is the oracle for the Triton kernels, so it is itself checked here against the
most literal formulation: contiguous K/V rebuilt token by token, an explicit causal loop.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from kernels import reference


def _naive(query, keys, values, q_lens, seq_lens, scale):
    """keys/values: per sequence [L, Hkv, D]; queries flattened [T, Hq, D]."""
    out = torch.empty_like(query, dtype=torch.float64)
    row = 0
    for k, v, ql, L in zip(keys, values, q_lens, seq_lens):
        group = query.shape[1] // k.shape[1]
        for i in range(ql):
            pos = L - ql + i
            for h in range(query.shape[1]):
                q = query[row + i, h].double()
                kk = k[: pos + 1, h // group].double()
                vv = v[: pos + 1, h // group].double()
                w = torch.softmax((kk @ q) * scale, dim=0)
                out[row + i, h] = w @ vv
        row += ql
    return out


def _setup(block_size, num_heads, num_kv_heads, q_lens, seq_lens, head_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-L // block_size) for L in seq_lens) + 5
    cache = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim, generator=g)  # garbage everywhere
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)  # non-contiguous block tables
    tables, keys, values = [], [], []
    slots = []
    for L, ql in zip(seq_lens, q_lens):
        nb = -(-L // block_size)
        table = [ids.pop() for _ in range(nb)]
        tables.append(table)
        k = torch.randn(L, num_kv_heads, head_dim, generator=g)
        v = torch.randn(L, num_kv_heads, head_dim, generator=g)
        keys.append(k)
        values.append(v)
        # Earlier context is already in the cache; this step's tokens are written by write_kv.
        for p in range(L - ql):
            cache[0, table[p // block_size], :, p % block_size] = k[p]
            cache[1, table[p // block_size], :, p % block_size] = v[p]
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(L - ql, L))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    new_k = torch.cat([k[L - ql :] for k, L, ql in zip(keys, seq_lens, q_lens)])
    new_v = torch.cat([v[L - ql :] for v, L, ql in zip(values, seq_lens, q_lens)])
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return cache, bt, new_k, new_v, torch.tensor(slots), query, qsl, keys, values


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [
        ([1, 1, 1], [1, 17, 40]),  # decode, lengths not multiples of the block size
        ([5, 13, 1], [5, 30, 9]),  # a fresh prefill, an extend over cached context, a decode
    ],
)
def test_paged_attention_matches_naive(block_size, num_heads, num_kv_heads, q_lens, seq_lens):
    cache, bt, k, v, slots, query, qsl, keys, values = _setup(block_size, num_heads, num_kv_heads, q_lens, seq_lens)
    reference.write_kv(k, v, cache, slots)
    scale = 1 / math.sqrt(query.shape[-1])
    out = reference.paged_attention(
        query, cache, bt, torch.tensor(seq_lens, dtype=torch.int32), qsl, scale, max(q_lens), max(seq_lens)
    )
    expected = _naive(query, keys, values, q_lens, seq_lens, scale)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_write_kv_skips_padding_slots_and_copy_blocks_copies_k_and_v():
    cache = torch.zeros(2, 4, 1, 2, 3)
    k = torch.ones(3, 1, 3)
    v = 2 * torch.ones(3, 1, 3)
    reference.write_kv(k, v, cache, torch.tensor([0, -1, 5]))
    assert cache[0, 0, 0, 0].eq(1).all() and cache[1, 2, 0, 1].eq(2).all()
    assert cache[:, 0, 0, 1].eq(0).all()  # slot 1 was padding
    reference.copy_blocks(cache, torch.tensor([2]), torch.tensor([3]))
    assert torch.equal(cache[:, 3], cache[:, 2])


def test_large_batches_are_split_without_changing_results(monkeypatch):
    args = _setup(8, 4, 2, [3, 1, 7, 2], [20, 9, 7, 33], seed=3)
    cache, bt, k, v, slots, query, qsl = args[:7]
    reference.write_kv(k, v, cache, slots)
    seq_lens = torch.tensor([20, 9, 7, 33], dtype=torch.int32)
    whole = reference.paged_attention(query, cache, bt, seq_lens, qsl, 0.25, 7, 33)
    monkeypatch.setattr(reference, "_MAX_SCORE_ELEMENTS", 1)  # one sequence per group
    split = reference.paged_attention(query, cache, bt, seq_lens, qsl, 0.25, 7, 33)
    torch.testing.assert_close(whole, split)
