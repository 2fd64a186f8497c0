"""Steps with prompt tokens replay the piecewise CUDA graphs (engine/runner/piecewise.py) on a GPU: the same
tokens as the engine with --enforce-eager (no graph at all), on mixed steps of many token counts (chunked prefill
on small and large budgets, decodes batched with prompt chunks, prefix-cache hits), with n > 1, seeded sampling,
logprobs and prompt logprobs, and steps past the largest bucket falling back to the plain forward."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runner.piecewise import MEASURED_ABOVE, PieceGraphs, candidate_buckets

SETTINGS = {
    "budget-40": dict(block_size=16, max_num_batched_tokens=40, enable_prefix_caching=True),
    "budget-1536": dict(block_size=16, max_num_batched_tokens=1536),  # steps past the largest bucket (1,024) too
}


def _workload(vocab: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(3)
    shared = [rng.randrange(vocab) for _ in range(48)]
    prompts, params = [], []
    for i in range(24):
        n = rng.choice([1, 5, 17, 40, 90, 200, 330, 440])
        prompts.append({"prompt_token_ids": (shared if i % 5 == 0 else []) + [rng.randrange(vocab) for _ in range(n)]})
        params.append(
            SamplingParams(
                temperature=0 if i % 2 == 0 else 0.7,
                seed=7 + i,
                max_tokens=rng.randrange(4, 16),
                n=1 + i % 3 // 2,
                logprobs=2 if i % 3 == 0 else None,
                prompt_logprobs=1 if i % 7 == 0 else None,
                ignore_eos=True,
            )
        )
    return prompts, params


def _run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, [sorted(e) for e in (c.logprobs or [])]) for c in o.outputs] for o in outs]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_piece_graphs_give_the_eager_engines_tokens(arch, setting, checkpoint):
    args = dict(
        device="cuda",
        dtype="float32",
        max_model_len=512,
        max_num_seqs=16,
        kv_cache_memory_bytes=256 << 20,
        swap_space=0,
    )
    results, counts = {}, {}
    for eager in (True, False):
        llm = LLM(str(checkpoint(arch)), enforce_eager=eager, **args, **SETTINGS[setting])
        try:
            runner = llm.llm_engine.core.runner
            steps: list[tuple[int, int | None]] = []
            prepare = runner.prepare

            def recording(plan, prepare=prepare, steps=steps):
                inputs = prepare(plan)
                if inputs.graph_size is None:
                    steps.append((inputs.num_tokens, inputs.piece_rows))
                return inputs

            runner.prepare = recording
            if not eager:
                pieces = runner.pieces
                assert isinstance(pieces, PieceGraphs) and pieces.graphs
                assert sorted(pieces.graphs) == pieces.buckets
                candidates = candidate_buckets(pieces.max_tokens)
                assert set(pieces.buckets) <= set(candidates) and pieces.buckets[-1] == candidates[-1]
                if pieces.max_tokens > MEASURED_ABOVE:  # the buckets above it were chosen by their measured costs
                    assert pieces.costs and set(pieces.costs) == {n for n in candidates if n > MEASURED_ABOVE}
                    assert all(n in pieces.buckets for n in candidates if n <= MEASURED_ABOVE)
                    print(f"\n{arch} {setting}: buckets {pieces.buckets}")
            prompts, params = _workload(llm.llm_engine.core.model_info.hf_config.vocab_size)
            results[eager] = _run(llm, prompts, params)
            counts[eager] = steps
        finally:
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    replayed = [(n, rows) for n, rows in counts[False] if rows is not None]
    plain = [n for n, rows in counts[False] if rows is None]
    print(
        f"\n{arch} {setting}: {len(replayed)} steps replayed piece graphs ({len({r for _, r in replayed})} buckets), "
        f"{len(plain)} eager steps with prompt tokens (largest {max(plain, default=0)} tokens)"
    )
    assert replayed and all(rows is None for _, rows in counts[True])
    assert results[False] == results[True]
