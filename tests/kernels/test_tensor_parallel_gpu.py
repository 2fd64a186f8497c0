"""Tensor parallelism on real GPUs (NCCL): CUDA graphs capture the all-reduces, tokens equal one GPU.

Needs at least 2 GPUs; skipped elsewhere (the CPU tests in tests/engine/test_tensor_parallel.py
cover the same logic over gloo).  float32 on a small checkpoint, so tokens must be identical.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.checkpoints import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _check_graphs(runner, tp: int) -> None:
    """(A function of its own, so that no local name keeps the runner, and its KV cache, alive after `del llm`.)"""
    assert runner.graphs is not None and runner.pieces is not None
    # the buckets above 256 tokens were chosen from timings summed over the ranks (an all-reduce), so every rank pads
    # a step alike: were they to differ, the graphs' all-reduces would not match and the tokens would not equal one
    # GPU's
    assert runner.pieces.costs, "the piece-graph buckets were not measured"
    print(f"tp={tp}: piece-graph buckets {runner.pieces.buckets}")


def _run(path, tp: int, eager: bool, prompts, params, sampled) -> tuple[list, list]:
    import time

    llm = LLM(
        str(path),
        tensor_parallel_size=tp,
        device="cuda",
        dtype="float32",
        max_model_len=256,
        max_num_seqs=16,
        enforce_eager=eager,
        gpu_memory_utilization=0.3,
    )
    if not eager:  # decode graphs, and the piecewise graphs of steps with prompt tokens (all-reduces inside)
        _check_graphs(llm.llm_engine.core.runner, tp)
    assert len(llm.llm_engine.core.memory_plans) == tp
    g = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    s = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sampled)]
    started = time.monotonic()
    llm.close()
    closed = time.monotonic() - started
    print(f"tp={tp} eager={eager}: close took {closed:.2f} s")
    assert closed < 10, "leaving the NCCL group hung (graphs must be released first)"
    del llm
    gc.collect()
    torch.cuda.empty_cache()  # the next engine's budget must not count this one's memory
    return g, s


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_tp2_on_gpus_matches_one_gpu(tmp_path, eager):
    path = make_checkpoint("llama", tmp_path / "llama", extra_vocab=3)
    rng = random.Random(3)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (1, 5, 17, 40, 90, 120)] * 3
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=i) for i in range(len(prompts))]
    one = _run(path, 1, eager, prompts, params, sampled)
    two = _run(path, 2, eager, prompts, params, sampled)
    assert two[0] == one[0]
    assert two[1] == one[1]
