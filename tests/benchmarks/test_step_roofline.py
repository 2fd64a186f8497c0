"""The schedule-aware roofline (benchmarks/step_roofline.py): the steps it replays are the ones the
engine ran, and each step's cost follows its definition."""

from __future__ import annotations

import pytest

from benchmarks.step_roofline import ModelCost, StepShape, bounds, recorded_steps, step_work
from benchmarks.throughput import long_tailed_workload, params_for, structured_rows
from engine import LLM

CFG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}


def test_model_cost_counts_every_projection_and_the_kv_of_every_layer():
    c = ModelCost.from_config(CFG, dtype_bytes=2)
    per_layer = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128
    assert c.linear_params == 2 * per_layer
    assert c.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert c.weight_bytes == (2 * per_layer + 64 * 100) * 2
    # one query at position 3 sees 4 keys; a 3-token chunk from 0 sees 1 + 2 + 3
    assert c.attention_flops(3, 1) == 2 * 4 * 4 * 16 * 4
    assert c.attention_flops(0, 3) == 2 * 4 * 4 * 16 * 6


def test_a_decode_step_is_bandwidth_bound_and_a_long_prefill_is_compute_bound():
    c = ModelCost.from_config(CFG, dtype_bytes=2)
    decode = StepShape(((10, 1), (20, 1)), samples=2)
    w = step_work(decode, c)
    assert w["bytes"] == c.weight_bytes + (11 + 21) * c.kv_bytes_per_token
    assert w["prefill_flops"] == 0 and w["decode_bytes"] == w["bytes"]
    prefill = StepShape(((0, 4000),), samples=1)
    wp = step_work(prefill, c)
    assert wp["decode_bytes"] == 0 and wp["prefill_flops"] == wp["flops"]
    # a GPU's ratio of ceilings: 100 FLOPs per byte moved
    b = bounds([decode, prefill], c, matmul_flops=100e12, copy_bytes_per_s=1e12)
    assert b["steps"] == 2 and b["compute_bound_steps"] == 1
    assert b["schedule_aware_s"] == pytest.approx(w["bytes"] / 1e12 + wp["flops"] / 100e12)
    # a compute-bound mixed step costs its FLOPs only, while the additive bound also pays the decode's bytes
    mixed = StepShape(((0, 4000), (50, 1)), samples=2)
    m = bounds([mixed], c, 100e12, 1e12)
    assert m["schedule_aware_s"] <= m["additive_s"]


def test_the_layer_sequential_bound_pays_projections_and_attention_one_after_the_other():
    """Many decodes with a prompt chunk: the projections are compute-bound, the decodes' KV reads bandwidth-bound.
    The schedule-aware bound takes the larger of the two for the whole step; the layer-sequential bound adds them,
    as a layer runs them, so it lies between that max and the sum, and equals the aware bound on a pure decode."""
    c = ModelCost.from_config(CFG, dtype_bytes=2)
    mixed = StepShape(tuple([(3000, 1)] * 200 + [(0, 2000)]), samples=201)
    w = step_work(mixed, c)
    assert w["kv_bytes"] == sum(s + n for s, n in mixed.seqs) * c.kv_bytes_per_token
    matmul, copy = 100e12, 1e12
    b = bounds([mixed], c, matmul, copy)
    projections = max(c.weight_bytes / copy, (w["flops"] - w["attention_flops"]) / matmul)
    attention = max(w["kv_bytes"] / copy, w["attention_flops"] / matmul)
    assert b["layer_sequential_s"] == pytest.approx(projections + attention)
    assert b["schedule_aware_s"] < b["layer_sequential_s"] <= 2 * b["schedule_aware_s"]
    decode = StepShape(((10, 1), (20, 1)), samples=2)
    d = bounds([decode], c, matmul, copy)
    assert d["layer_sequential_s"] == pytest.approx(d["schedule_aware_s"])


def test_the_recorded_steps_are_the_work_the_engine_did():
    llm = LLM(block_size=8, max_num_batched_tokens=64, max_num_seqs=8)
    try:
        work = long_tailed_workload(20, 200, seed=3, prompt_median=12, output_median=6, prompt_cap=40, output_cap=16)
        with recorded_steps(llm) as steps:
            llm.generate([{"prompt_token_ids": p} for p, _ in work], params_for(work), use_tqdm=False)
        assert llm.llm_engine.core.scheduler.schedule.__func__ is type(llm.llm_engine.core.scheduler).schedule
    finally:
        llm.close()
    prompt_tokens, output_tokens = sum(len(p) for p, _ in work), sum(o for _, o in work)
    # every prompt token and every output token but the last of each request gets its KV computed
    assert sum(s.tokens for s in steps) == prompt_tokens + output_tokens - len(work)
    assert sum(s.samples for s in steps) == output_tokens
    assert all(s.tokens <= 64 and len(s.seqs) <= 8 for s in steps)  # the engine's limits held
    assert any(n > 1 for s in steps for _, n in s.seqs) and any(len(s.seqs) > 1 for s in steps)
    print(f"{len(steps)} steps, {prompt_tokens} prompt + {output_tokens} output tokens")


def test_structured_rows_spread_the_fraction_evenly():
    rows = structured_rows(1000, 0.25)
    assert len(rows) == 250 and max(rows) - min(rows) > 900
    assert structured_rows(10, 0.0) == frozenset() and len(structured_rows(10, 1.0)) == 10


def test_the_long_tailed_workload_is_seeded_and_capped():
    a = long_tailed_workload(500, 1000, seed=1, prompt_median=200, output_median=200, prompt_cap=2048, output_cap=1024)
    assert a == long_tailed_workload(500, 1000, 1, 200, 200, 2048, 1024)
    plens = sorted(len(p) for p, _ in a)
    olens = sorted(o for _, o in a)
    assert 120 < plens[250] < 330 and 120 < olens[250] < 330  # medians near 200
    assert plens[-1] <= 2048 and olens[-1] <= 1024 and plens[-1] > 4 * plens[250]  # a long tail
