"""The CPU backend (token-major "NHD" cache) against the torch reference (head-major cache) on the same keys and
values: decode, grouped-query heads, sequences of different lengths (padded tables), prefill chunks alone and in
mixed steps (decodes first), same-length groups, bfloat16 caches, cache writes; and the engine picks it on the
CPU."""

from __future__ import annotations

import threading

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


def _nhd(cache: torch.Tensor) -> torch.Tensor:
    """The same keys and values in the CPU backend's layout."""
    return cache.permute(0, 1, 3, 2, 4).contiguous()


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_the_reference(heads, kv_heads, block_size, dtype):
    cache, tables, lens = _case(7, heads, kv_heads, block_size, dtype, seed=block_size + heads)
    q = torch.randn(7, heads, 32).to(dtype)
    qsl = torch.arange(8, dtype=torch.int32)
    want = reference.paged_attention(q, cache, tables, lens, qsl, 0.17, 1, int(lens.max()))
    got = cpu_backend.paged_attention(q, _nhd(cache), tables, lens, qsl, 0.17, 1, int(lens.max()))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_mixed_step_equals_the_reference():
    cache, tables, lens = _case(6, 8, 2, 16, torch.float32, seed=3)
    q_lens = [1, 1, 1, 5, 12, 1]  # three decodes first, then two prefill chunks, then ... a chunk of 1
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    lens = torch.maximum(lens, torch.tensor(q_lens, dtype=torch.int32))
    q = torch.randn(int(qsl[-1]), 8, 32)
    want = reference.paged_attention(q, cache, tables, lens, qsl, 0.2, 12, int(lens.max()))
    got = cpu_backend.paged_attention(q, _nhd(cache), tables, lens, qsl, 0.2, 12, int(lens.max()), num_decodes=3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_groups_equal_the_reference(dtype):
    """Chunks of equal (chunk, context) lengths share one call; others run alone; all match the reference."""
    cache, tables, _ = _case(7, 8, 4, 16, dtype, seed=11)
    q_lens = [9, 9, 9, 4, 9, 1, 17]
    lens = torch.tensor([40, 40, 40, 22, 33, 5, 17], dtype=torch.int32)  # the first three form a group
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), 8, 32).to(dtype)
    want = reference.paged_attention(q, cache, tables, lens, qsl, 0.15, 17, 40)
    got = cpu_backend.paged_attention(q, _nhd(cache), tables, lens, qsl, 0.15, 17, 40)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_writes_land_where_the_reference_writes_them():
    heads, dim, bs = 2, 8, 16
    ref = torch.zeros(2, 6, heads, bs, dim)
    mine = torch.zeros(cpu_backend.kv_cache_shape(6, heads, bs, dim))
    k, v = torch.randn(5, heads, dim), torch.randn(5, heads, dim)
    slots = torch.tensor([3, 17, -1, 95, 40])  # -1: padding, never written
    reference.write_kv(k, v, ref, slots)
    cpu_backend.write_kv(k, v, mine, slots)
    torch.testing.assert_close(_nhd(ref), mine, rtol=0, atol=0)


def test_the_engine_uses_it_on_the_cpu():
    assert kernels.attention_backend("cpu") is cpu_backend


def test_the_gather_reuses_one_buffer_per_role_and_allocates_past_the_cap(monkeypatch):
    cache = torch.randn(32, 8, 2, 16)
    table = torch.tensor([[3, 1, 4], [1, 5, 9]])
    first = cpu_backend._gather(cache, table, "k")
    expected = cache[table.reshape(-1)].view(2, 24, 2, 16).transpose(1, 2)
    assert torch.equal(first, expected)
    ptr = first.data_ptr()
    second = cpu_backend._gather(cache, table[:, :2], "k")  # smaller: the same memory
    assert second.data_ptr() == ptr and torch.equal(second, expected[:, :, :16])
    assert cpu_backend._gather(cache, table, "v").data_ptr() != ptr  # K and V are read together

    def engine_then_test() -> None:  # a fresh thread: its buffers are made under inference mode first
        with torch.inference_mode():  # as the engine gathers
            assert torch.equal(cpu_backend._gather(cache, table, "k"), expected)
        assert torch.equal(cpu_backend._gather(cache, table, "k"), expected)  # an inference tensor is not reused

    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _record(errors, engine_then_test))
    t.start()
    t.join()
    assert not errors, errors
    monkeypatch.setattr(cpu_backend, "_SCRATCH_CAP_BYTES", 1024)
    big = cpu_backend._gather(cache, table, "k")
    assert big.data_ptr() != ptr and torch.equal(big, expected)


def _record(errors: list[BaseException], fn) -> None:  # type: ignore[no-untyped-def]
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - reported by the test's own thread
        errors.append(e)
