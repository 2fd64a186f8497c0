from __future__ import annotations

import pytest

from engine.kv.block_pool import BlockPool, NoFreeBlocksError
from engine.kv.kv_cache_manager import KVCacheManager, blocks_for_tokens


def test_pool_allocates_all_or_nothing_and_counts_owners():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and all(pool.ref_count(b) == 1 for b in a)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1  # the failed request took nothing
    pool.share(a[:1])
    pool.release(a)
    assert pool.num_free == 3 and pool.ref_count(a[0]) == 1  # still owned by the sharer
    pool.release(a[:1])
    assert pool.num_free == 4 and pool.usage() == 0.0


def test_pool_rejects_double_release_and_sharing_free_blocks():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(ValueError):
        pool.release([b])
    with pytest.raises(ValueError):
        pool.share([b])


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_tables_grow_on_demand(block_size):
    kv = KVCacheManager(num_blocks=10, block_size=block_size)
    assert kv.allocate_slots("a", 1)
    assert len(kv.block_table("a")) == 1
    assert kv.allocate_slots("a", block_size)  # still fits the first block
    assert len(kv.block_table("a")) == 1
    assert kv.allocate_slots("a", block_size + 1)
    assert len(kv.block_table("a")) == 2
    assert kv.tokens_capacity("a") == 2 * block_size
    assert kv.blocks_needed("a", 5 * block_size) == 3


def test_allocate_slots_fails_without_partial_allocation():
    kv = KVCacheManager(num_blocks=3, block_size=8)
    assert kv.allocate_slots("a", 16)
    assert not kv.allocate_slots("b", 17)  # needs 3 blocks, 1 free
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    kv.free("a")
    kv.free("a")  # idempotent: a sequence freed twice returns its blocks once
    assert kv.num_free_blocks == 3
    assert kv.allocate_slots("b", 17)
    assert len(set(kv.block_table("b"))) == 3


def test_blocks_for_tokens():
    assert [blocks_for_tokens(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
