"""Issue 5, CPU half: a bounded prefix cache, copy-on-write for n > 1, swap and recompute
preemption — all giving the same tokens as an unpressured run, and every block back at the end."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


def _block_bytes(llm: LLM) -> int:
    return llm.llm_engine.core.kv_plan.bytes_per_block


def _all_free(llm: LLM) -> None:
    kv = llm.llm_engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.num_sequences() == 0
    if kv.cpu_pool is not None:
        assert kv.cpu_pool.num_free == kv.cpu_pool.num_blocks and kv.num_swapped() == 0


@pytest.fixture(scope="module")
def vocab() -> int:
    return LLM(max_model_len=64, kv_cache_memory_bytes=1 << 20).llm_engine.core.model_info.hf_config.vocab_size


def test_a_thousand_distinct_prefixes_through_64_blocks(vocab):
    probe = LLM(block_size=16, max_model_len=64, kv_cache_memory_bytes=1 << 20)
    llm = LLM(
        block_size=16, max_model_len=64, enable_prefix_caching=True, kv_cache_memory_bytes=64 * _block_bytes(probe)
    )
    kv = llm.llm_engine.core.kv
    assert kv.num_blocks == 64
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(3 * 16 + 1)]} for _ in range(1000)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert len(outs) == 1000 and all(len(o.outputs[0].token_ids) == 2 for o in outs)
    assert kv.pool.num_cached <= 64 and kv.usage() == 0.0
    assert kv.pool.evictions > 900  # the cache turned over instead of growing
    _all_free(llm)  # cached blocks count as free: the cache holds nothing anyone else needs


def test_hit_rate_matches_a_hand_count_and_hits_change_nothing(vocab):
    rng = random.Random(3)
    bs = 16
    a = [rng.randrange(4, vocab) for _ in range(3 * bs + 5)]
    b = [rng.randrange(4, vocab) for _ in range(3 * bs + 5)]
    c = a[: 2 * bs] + [rng.randrange(4, vocab) for _ in range(bs + 5)]  # shares A's first two blocks
    plain = LLM(block_size=bs, max_model_len=128)
    cached = LLM(block_size=bs, max_model_len=128, enable_prefix_caching=True)
    p = SamplingParams(max_tokens=6, **GREEDY)
    expected_hits = [0, 3 * bs, 0, 2 * bs, 3 * bs]  # A, A again, B, C (2 blocks of A), A
    kv = cached.llm_engine.core.kv
    for prompt, hits in zip([a, a, b, c, a], expected_hits):
        before = kv.prefix_hits
        got = cached.generate([{"prompt_token_ids": prompt}], p, use_tqdm=False)[0].outputs[0].token_ids
        want = plain.generate([{"prompt_token_ids": prompt}], p, use_tqdm=False)[0].outputs[0].token_ids
        assert kv.prefix_hits - before == hits
        assert got == want  # the extend path over cached blocks computes the same tokens
    assert kv.prefix_queries == 5 * (3 * bs + 5)
    assert kv.prefix_hits == sum(expected_hits)
    snap = cached.llm_engine.core.snapshot()
    assert snap.prefix_hit_rate == pytest.approx(sum(expected_hits) / (5 * (3 * bs + 5)))
    _all_free(cached)


def test_n_sequences_share_the_prompt_and_copy_the_partial_block_on_write():
    llm = LLM(block_size=8)
    engine = llm.llm_engine
    kv = engine.core.kv
    tok = llm.get_tokenizer()
    prompt = tok("Errors should never pass silently. Unless")["input_ids"]
    assert len(prompt) % 8 != 0  # the prompt ends inside a block
    engine.add_request(
        "fork",
        {"prompt_token_ids": prompt},
        SamplingParams(n=4, temperature=1.5, seed=11, max_tokens=10, ignore_eos=True),
    )
    engine.step()  # prefill of the first sequence; the other three fork its blocks
    tables = [kv.block_table(f"fork#{i}") for i in range(4)]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == -(-len(prompt) // 8)
    assert all(kv.pool.ref_count(b) == 4 for b in tables[0])
    used_after_prefill = kv.pool.num_used
    engine.step()  # every sequence writes into the shared partial block: 3 copies, the last writes in place
    assert kv.cow_copies == 3
    assert kv.pool.num_used == used_after_prefill + 3
    full = tables[0][:-1]
    assert all(kv.pool.ref_count(b) == 4 for b in full)  # full prompt blocks stay shared
    while engine.has_unfinished_requests():
        engine.step()
    _all_free(llm)


def test_n4_with_forks_equals_four_separately_seeded_requests():
    llm = LLM(block_size=8)
    prompt = "Special cases aren't"
    together = llm.generate(
        [prompt],
        SamplingParams(n=4, temperature=1.2, top_p=0.9, max_tokens=16, seed=40, ignore_eos=True),
        use_tqdm=False,
    )[0]
    for i, c in enumerate(together.outputs):
        alone = llm.generate(
            [prompt],
            SamplingParams(temperature=1.2, top_p=0.9, max_tokens=16, seed=40 + i, ignore_eos=True),
            use_tqdm=False,
        )[0]
        assert c.token_ids == alone.outputs[0].token_ids
    _all_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_by_swap_or_recompute_gives_unpressured_tokens(mode, vocab):
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(rng.randrange(5, 40))]} for _ in range(10)]
    p = SamplingParams(max_tokens=40, **GREEDY)
    relaxed = LLM(block_size=8, max_model_len=128)
    want = [o.outputs[0].token_ids for o in relaxed.generate(prompts, p, use_tqdm=False)]
    per_block = _block_bytes(LLM(block_size=8, max_model_len=128, kv_cache_memory_bytes=1 << 20))
    tight = LLM(
        block_size=8,
        max_model_len=80,
        kv_cache_memory_bytes=12 * per_block,
        preemption_mode=mode,
        swap_space=(64 * per_block) / 2**30,
    )
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, p, use_tqdm=False)]
    core = tight.llm_engine.core
    assert core.scheduler.num_preemptions > 0
    if mode == "swap":
        assert core.kv.num_cpu_blocks == 64 and core.kv.blocks_swapped_out > 0
    else:
        assert core.kv.cpu_pool is None
    assert got == want
    _all_free(tight)


def test_swap_falls_back_to_recompute_when_swap_space_is_full(vocab):
    rng = random.Random(9)
    prompts = [{"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(30)]} for _ in range(8)]
    p = SamplingParams(max_tokens=30, **GREEDY)
    want = [o.outputs[0].token_ids for o in LLM(block_size=8, max_model_len=128).generate(prompts, p, use_tqdm=False)]
    per_block = _block_bytes(LLM(block_size=8, max_model_len=128, kv_cache_memory_bytes=1 << 20))
    tight = LLM(
        block_size=8,
        max_model_len=64,
        kv_cache_memory_bytes=10 * per_block,
        preemption_mode="swap",
        swap_space=(4 * per_block) / 2**30,
    )  # room for one small sequence at most
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, p, use_tqdm=False)]
    assert got == want
    _all_free(tight)
