"""How the model splits over tensor-parallel ranks, computed without starting any (fast)."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, EngineConfig
from engine.memory.budget import KVPlan, ranks_table
from engine.memory.estimate import estimate
from engine.parallel.group import HeadSplit, Part, TPGroup


def test_heads_split_evenly_or_kv_heads_are_replicated():
    # 32 query heads, 8 KV heads over 4 ranks: 8 + 2 each, in rank order.
    s = HeadSplit.of(32, 8, TPGroup(3, 4))
    assert (s.num_heads, s.num_kv_heads, s.q.start, s.kv.start) == (8, 2, 24, 6)
    # 4 query heads, 2 KV heads over 4 ranks: each rank holds the one KV head its query head reads.
    for rank in range(4):
        s = HeadSplit.of(4, 2, TPGroup(rank, 4))
        assert (s.num_heads, s.num_kv_heads, s.q.start, s.kv.start) == (1, 1, rank, rank // 2)
        assert s.q.start // (4 // 2) == s.kv.start  # GQA: query head h reads KV head h // group


def test_splits_that_cannot_work_name_the_flag_and_the_sizes_that_would():
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 does not divide the model's 32 attention heads"):
        HeadSplit.of(32, 8, TPGroup(0, 3))
    with pytest.raises(ValueError, match="neither a divisor nor a multiple of the model's 3 key/value heads"):
        HeadSplit.of(12, 3, TPGroup(0, 4))
    with pytest.raises(ValueError, match="does not divide the model's intermediate_size"):
        Part.even(100, TPGroup(0, 3), "intermediate_size")


def test_the_vocabulary_is_padded_to_a_multiple_of_the_ranks():
    parts = [Part.padded(387, TPGroup(r, 4)) for r in range(4)]
    assert [(p.start, p.size, p.real) for p in parts] == [(0, 97, 97), (97, 97, 97), (194, 97, 97), (291, 97, 96)]


def test_the_estimate_gives_every_rank_its_shard_and_its_kv_heads():
    one = estimate(EngineConfig(kv_cache_memory_bytes=1 << 24))
    two = estimate(EngineConfig(kv_cache_memory_bytes=1 << 24, tensor_parallel_size=2))
    four = estimate(EngineConfig(kv_cache_memory_bytes=1 << 24, tensor_parallel_size=4))
    assert len(two.ranks) == 2 and len(four.ranks) == 4
    # Every matrix is split; only the norms (a few hundred floats) are replicated.
    assert abs(sum(r.weight_bytes for r in two.ranks) - one.weight_bytes) < 0.01 * one.weight_bytes
    # 2 KV heads: one per rank at 2, the same one replicated at 4; the same budget holds more tokens.
    assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2 == four.kv_bytes_per_token
    assert two.usable_kv_tokens == 2 * (one.usable_kv_tokens or 0)
    with pytest.raises(ConfigError, match="--tensor-parallel-size 3"):
        estimate(EngineConfig(tensor_parallel_size=3))


def test_the_memory_plan_table_shows_every_rank_and_the_blocks_they_agree_on():
    plans = [KVPlan(num_blocks=n, bytes_per_block=1024, kv_bytes=n * 1024, source="test") for n in (120, 100)]
    table = ranks_table(plans)
    assert "rank 0" in table and "rank 1" in table
    assert table.splitlines()[-1].split() == ["KV", "blocks", "every", "rank", "uses", "100", "100"]
