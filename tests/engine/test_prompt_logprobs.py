"""Must-show 3 (engine side): prompt logprobs equal transformers' on the same checkpoint (float32, CPU)
with chunked prefill splitting prompts, prefix caching on (a cached prefix must not skip the
positions it would have scored) and a KV pool small enough to preempt (recomputed positions are kept
once)."""

from __future__ import annotations

import random

import torch

from engine import LLM, SamplingParams


def test_prompt_logprobs_equal_transformers(checkpoint):
    from transformers import AutoModelForCausalLM

    path = checkpoint("llama")
    hf = AutoModelForCausalLM.from_pretrained(str(path)).float().eval()
    rng = random.Random(3)
    shared = [rng.randrange(hf.config.vocab_size) for _ in range(40)]
    prompts = [shared + [rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (3, 17, 30)]
    prompts.append([rng.randrange(hf.config.vocab_size) for _ in range(9)])
    probe = LLM(str(path), block_size=8, max_model_len=96)
    per_block = probe.llm_engine.core.kv_plan.bytes_per_block
    del probe
    llm = LLM(
        str(path),
        block_size=8,
        max_model_len=96,
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=16 * per_block,
        seed=0,
    )
    # the first request fills the prefix cache with the shared prefix; the others would hit it
    first = llm.generate(
        {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert first[0].prompt_logprobs is None  # not asked for: not computed
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=3, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    worst, scored = 0.0, 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
            assert out.prompt_logprobs[0] is None
            for pos in range(1, len(prompt)):
                entry = out.prompt_logprobs[pos]
                assert entry is not None
                row = ref[pos - 1]
                want = row[prompt[pos]].item()
                worst = max(worst, abs(entry[prompt[pos]].logprob - want))
                assert entry[prompt[pos]].rank == int((row > row[prompt[pos]]).sum()) + 1
                top = row.topk(3)
                for t, v in zip(top.indices.tolist(), top.values.tolist()):
                    assert abs(entry[t].logprob - v) < 1e-4
                scored += 1
    kv = llm.llm_engine.core.kv
    preempted = llm.llm_engine.core.scheduler.num_preemptions
    print(
        f"{scored} prompt positions: max |logprob - transformers| = {worst:.2e}; "
        f"{preempted} preemptions, prefix hits {kv.prefix_hits} tokens"
    )
    assert worst < 1e-4 and preempted > 0
