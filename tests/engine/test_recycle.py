"""Recycling the KV pool in place (EngineCore.recycle): leaked blocks come back, no request is lost, and every
request gives the tokens an undisturbed run gives (greedy in float32, and seeded sampling), because each one is
recomputed from the tokens it has with its own random stream."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.loop.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PROMPTS = ["Beautiful is", "Errors should never", "Now is better than", "Special cases aren't"]


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=24, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _run(engine: LLMEngine, tag: str, disturb_after: int | None = None) -> tuple[dict[str, list[int]], dict]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{tag}{i}", p, _params(i))
    done: dict[str, list[int]] = {}
    report = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id.removeprefix(tag)] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == disturb_after:
            leaked = engine.core.kv.pool.allocate(7)  # a bug's leak: held by no sequence
            assert leaked and engine.core.kv.num_held_blocks() > 7
            outputs, rep = engine.recycle()
            for out in outputs:
                if out.finished:
                    done[out.request_id.removeprefix(tag)] = list(out.outputs[0].token_ids)
            report = rep.__dict__
            assert engine.core.kv.num_held_blocks() == 0, "the pool is empty after a recycle"
    return done, report


@pytest.mark.parametrize("depth", [1, 2])
def test_a_recycle_mid_generation_loses_nothing_and_changes_no_token(depth):
    engine = LLMEngine(EngineConfig(device="cpu", max_num_on_the_fly_batches=depth))
    reference, _ = _run(engine, "ref-")
    recycled, report = _run(engine, "rec-", disturb_after=6)
    assert recycled == reference
    assert all(len(t) == 24 for t in recycled.values())
    assert report["requeued"] == len(PROMPTS) and report["reclaimed_blocks"] == 7
    assert report["usage_before"] > 0


def test_a_recycle_reclaims_leaked_blocks_and_empties_the_prefix_cache():
    engine = LLMEngine(EngineConfig(device="cpu", enable_prefix_caching=True))
    _run(engine, "warm-")  # fills the prefix cache
    kv = engine.core.kv
    assert kv.pool.num_cached > 0
    kv.pool.allocate(11)
    assert kv.usage() > 0
    outputs, report = engine.recycle()
    assert outputs == [] and report.requeued == 0 and report.reclaimed_blocks == 11
    assert kv.usage() == 0 and kv.pool.num_cached == 0 and kv.num_free_blocks == kv.num_blocks
    again, _ = _run(engine, "after-")
    assert len(again) == len(PROMPTS)


def test_a_recycled_constrained_request_is_counted_once_and_still_obeys_its_grammar():
    """A requeue keeps the scheduler's count of grammar-constrained sequences (a preemption once added one each
    time, which kept the pipeline synchronous for good) and the grammar's state: the text still matches."""
    import re

    from engine.sampling_params import StructuredOutputsParams

    engine = LLMEngine(EngineConfig(device="cpu"))
    params = SamplingParams(temperature=0.0, max_tokens=20)
    params.structured_outputs = StructuredOutputsParams(regex=r"[0-9]{3}\.[a-z]{2}")
    engine.add_request("a", "Now is", params)
    engine.step()
    engine.step()
    assert engine.core.scheduler.num_constrained == 1
    engine.recycle()
    assert engine.core.scheduler.num_constrained == 1
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                text = out.outputs[0].text
    assert re.fullmatch(r"[0-9]{3}\.[a-z]{2}", text), text
    assert engine.core.scheduler.num_constrained == 0
