"""An eager step hands the LM head a padded row count (engine/runner/model_runner.py, lm_head_rows): on CUDA,
cuBLAS waits for all queued work the first time it meets a row count for the vocabulary-wide GEMM, so the rows
are padded to the sizes the decode graphs and start-up already met.  Padding changes when work happens, never
what comes out: the extra rows repeat the last one and are cut off before sampling.

Off CUDA nothing is padded, so this test gives a CPU engine the CUDA sizes and compares it with a plain one on a
workload that samples many different row counts per step (prefill chunks, n > 1 siblings, seeds, logprobs)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.runner.cuda_graphs import capture_sizes


def _workload(vocab: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(5)
    prompts, params = [], []
    for i in range(13):
        prompts.append({"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(rng.randrange(1, 60))]})
        params.append(
            SamplingParams(
                temperature=0 if i % 3 == 0 else 0.9,
                seed=40 + i,
                max_tokens=rng.randrange(2, 18),
                n=1 + i % 3,
                logprobs=3 if i % 2 else None,
                ignore_eos=True,
            )
        )
    return prompts, params


def _summary(outs) -> list:
    return [[(c.token_ids, c.finish_reason, [sorted(e) for e in (c.logprobs or [])]) for c in o.outputs] for o in outs]


def test_padded_lm_head_rows_give_the_same_outputs():
    plain = LLM(max_model_len=128, device="cpu", max_num_seqs=32)
    padded = LLM(max_model_len=128, device="cpu", max_num_seqs=32)
    runner = padded.llm_engine.core.runner
    runner.lm_head_sizes = capture_sizes(32)  # the CUDA sizes: 1, 2, 4, 8, 16, 32
    seen: list[tuple[int, int]] = []
    compute = runner.model.compute_logits

    def recording(hidden):
        logits = compute(hidden)
        seen.append((hidden.shape[0], logits.shape[0]))
        return logits

    runner.model.compute_logits = recording
    vocab = plain.llm_engine.core.model_info.hf_config.vocab_size
    prompts, params = _workload(vocab)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = padded.generate(prompts, params, use_tqdm=False)
    print(f"\nLM head row counts given: {sorted({r for r, _ in seen})}")
    assert _summary(got) == _summary(want)
    for g, w in zip(got, want):
        for cg, cw in zip(g.outputs, w.outputs):
            for eg, ew in zip(cg.logprobs or [], cw.logprobs or []):
                # another row count may take another GEMM kernel: the same values up to rounding
                got_values, want_values = [eg[t].logprob for t in sorted(eg)], [ew[t].logprob for t in sorted(ew)]
                assert got_values == pytest.approx(want_values, abs=1e-4)
    assert seen and {r for r, _ in seen} <= set(capture_sizes(32))
    assert any(r > 1 for r, _ in seen)
