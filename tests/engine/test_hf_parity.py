"""Must-show 1: greedy tokens equal transformers' generate, and logits agree to 1e-4 relative.

For each architecture, one batch of prompts of different lengths (>= 8), across block sizes 8, 16
and 32, chunked prefill on (with a small token budget so prompts really are split) and off, and a
KV pool small enough that the scheduler must preempt.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.plan import NewSeq, SamplingSpec, SeqStep, StepPlan
from tests.checkpoints import ARCHS

MAX_TOKENS = 24
PROMPT_LENGTHS = (1, 3, 7, 8, 16, 17, 33, 50, 64, 90)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(checkpoint):
    """(prompts, transformers' greedy continuations, the HF model) per architecture, computed once."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = checkpoint(arch)
            hf = AutoModelForCausalLM.from_pretrained(str(path)).float().eval()
            prompts = _prompts(hf.config.vocab_size)
            expected = []
            with torch.inference_mode():
                for p in prompts:
                    ids = torch.tensor([p])
                    out = hf.generate(
                        ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
                    )
                    expected.append(out[0, len(p) :].tolist())
            cache[arch] = (prompts, expected, hf)
        return cache[arch]

    return get


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs]


def _assert_pool_empty(llm: LLM) -> None:
    kv = llm.llm_engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.num_sequences() == 0


ENGINE_SETTINGS = {
    "bs8-chunked": dict(block_size=8, enable_chunked_prefill=True, max_num_batched_tokens=40),
    "bs16-chunked": dict(block_size=16, enable_chunked_prefill=True, max_num_batched_tokens=40),
    "bs32-chunked": dict(block_size=32, enable_chunked_prefill=True, max_num_batched_tokens=40),
    "bs8-unchunked": dict(block_size=8, enable_chunked_prefill=False),
    "bs16-unchunked": dict(block_size=16, enable_chunked_prefill=False),
    "bs32-unchunked": dict(block_size=32, enable_chunked_prefill=False),
    "bs16-prefix-cache": dict(
        block_size=16, enable_chunked_prefill=True, max_num_batched_tokens=40, enable_prefix_caching=True
    ),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
def test_greedy_tokens_match_transformers(arch, setting, checkpoint, reference):
    prompts, expected, _ = reference(arch)
    llm = LLM(str(checkpoint(arch)), max_model_len=256, **ENGINE_SETTINGS[setting])
    assert _greedy(llm, prompts) == expected
    _assert_pool_empty(llm)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size,mode", [(8, "recompute"), (16, "recompute"), (8, "swap")])
def test_greedy_tokens_match_transformers_under_preemption(arch, block_size, mode, checkpoint, reference):
    prompts, expected, _ = reference(arch)
    core_probe = LLM(str(checkpoint(arch)), max_model_len=128, block_size=block_size, kv_cache_memory_bytes=1 << 20)
    per_block = core_probe.llm_engine.core.kv_plan.bytes_per_block
    # Room for the longest request alone (90 + 24 tokens) and not much more: the batch must preempt.
    blocks = -(-(max(PROMPT_LENGTHS) + MAX_TOKENS) // block_size) + 1
    llm = LLM(
        str(checkpoint(arch)),
        max_model_len=128,
        block_size=block_size,
        kv_cache_memory_bytes=blocks * per_block,
        max_num_batched_tokens=64,
        preemption_mode=mode,
        swap_space=(4 * blocks * per_block) / 2**30,
    )
    assert llm.llm_engine.core.kv.num_blocks == blocks
    assert _greedy(llm, prompts) == expected
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    assert (llm.llm_engine.core.kv.blocks_swapped_out > 0) == (mode == "swap")
    _assert_pool_empty(llm)


def _engine_logits(llm: LLM, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits for every position of `ids`, computed chunk by chunk through the paged KV path."""
    engine = llm.llm_engine
    core = engine.core
    (sid,) = engine.add_request("logits-probe", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    rows = []
    try:
        for start in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - start)
            assert core.kv.allocate_slots(sid, start + n)
            plan = StepPlan(
                [SeqStep(sid, start, n, ids[start : start + n], table_blocks=list(core.kv.block_table(sid)))],
                new_seqs=[NewSeq(sid, SamplingSpec())] if start == 0 else [],
            )
            core.runner.update_state(plan)
            inputs = core.runner.prepare(plan)
            with torch.inference_mode():
                rows.append(core.model.compute_logits(core.runner.forward_hidden(inputs)).float())
    finally:
        engine.abort_request("logits-probe")
        core.runner.update_state(StepPlan(finished=[sid]))
    return torch.cat(rows)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_logits_match_transformers(arch, chunk, checkpoint, reference):
    """chunk=1 is the decode path, 5 is chunked prefill over earlier blocks, 64 a whole prefill."""
    prompts, _, hf = reference(arch)
    ids = prompts[-1][:64]
    llm = LLM(str(checkpoint(arch)), max_model_len=128, block_size=8)
    ours = _engine_logits(llm, ids, chunk)
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < 1e-4, f"max relative logit error {rel:.2e}"
    _assert_pool_empty(llm)
