"""Tensor parallelism on real GPUs (NCCL): CUDA graphs capture the all-reduces, tokens equal one GPU.

Needs at least 2 GPUs (the TP=4 cases 4); skipped elsewhere (the CPU tests in tests/engine/test_tensor_parallel.py
and tests/engine/test_tp_overlap.py cover the same logic over gloo).  float32 on a small checkpoint, so tokens must
be identical.  Every sum these steps do fits the symmetric-memory buffer (engine/parallel/peer_allreduce.py), so
the first TP engine's graphs sum through it (a process sets it up once; the later engines sum through NCCL), the
overlapped micro-batches through NCCL.  Three ways a step runs, each
against one GPU run the same way:

- graphs: decode graphs and the piecewise graphs of steps with prompt tokens (all-reduces captured inside);
- eager: every step launched from Python (the all-reduces outside any graph);
- overlap: --tensor-parallel-overlap-tokens 64 with graphs on: the first step (30 prompts, 1,365 tokens, above
  the largest piece graph) runs eagerly as two micro-batches whose all-reduces are asynchronous, on NCCL's
  high-priority stream (engine/model/overlap.py), the decodes after it in graphs.
"""

from __future__ import annotations

import gc
import random
import time

import pytest
import torch

from engine import LLM, SamplingParams
from tests.checkpoints import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

LENGTHS = (1, 5, 17, 40, 90, 120)
VARIANTS = {
    "graphs": (dict(max_num_seqs=16), 3),  # engine arguments, copies of LENGTHS in the prompts
    "eager": (dict(max_num_seqs=16, enforce_eager=True), 3),
    "overlap": (dict(max_num_seqs=32, max_num_batched_tokens=2048), 5),
}
OVERLAP_TOKENS = 64
TP_ENGINES_MADE: list[int] = []  # the tensor-parallel engines this process made, in order


def _check_graphs(runner, tp: int) -> None:
    """(A function of its own, so that no local name keeps the runner, and its KV cache, alive after `del llm`.)"""
    assert runner.graphs is not None and runner.pieces is not None
    # the buckets above 256 tokens were chosen from timings summed over the ranks (an all-reduce), so every rank pads
    # a step alike: were they to differ, the graphs' all-reduces would not match and the tokens would not equal one
    # GPU's
    assert runner.pieces.costs, "the piece-graph buckets were not measured"
    print(f"tp={tp}: piece-graph buckets {runner.pieces.buckets}")


def _peer(runner):
    return runner.local.model.tp.peer


def _overlapped_steps(runner) -> int:
    return runner.local.model.overlapped_steps


def _run(path, tp: int, variant: str) -> tuple[list, list]:
    args, copies = VARIANTS[variant]
    rng = random.Random(3)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in LENGTHS] * copies
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=i) for i in range(len(prompts))]
    extra = {"tensor_parallel_overlap_tokens": OVERLAP_TOKENS} if variant == "overlap" and tp > 1 else {}
    llm = LLM(
        str(path),
        tensor_parallel_size=tp,
        device="cuda",
        dtype="float32",
        max_model_len=256,
        gpu_memory_utilization=0.3,
        **args,
        **extra,
    )
    if not args.get("enforce_eager"):  # decode graphs, and the piecewise graphs of steps with prompt tokens
        _check_graphs(llm.llm_engine.core.runner, tp)
    assert len(llm.llm_engine.core.memory_plans) == tp
    if tp > 1:  # PAGEKEEPER_TP_ALLREDUCE=auto: the first TP engine of this process sums on symmetric memory (all
        # of these steps' sums fit), the later ones through NCCL (one set-up per process: peer_allreduce.py)
        first = not TP_ENGINES_MADE
        TP_ENGINES_MADE.append(tp)
        peer = _peer(llm.llm_engine.core.runner)
        assert (peer is not None) == first, f"symmetric-memory all-reduce in use: {peer is not None}, first: {first}"
    before = _overlapped_steps(llm.llm_engine.core.runner) if extra else 0
    g = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    s = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sampled)]
    if extra:
        steps = _overlapped_steps(llm.llm_engine.core.runner) - before
        print(f"tp={tp} overlap: {steps} forwards of the two generate calls ran as two micro-batches")
        assert steps >= 2, "the first step of each generate call (1,365 tokens, eager) did not split"
    started = time.monotonic()
    llm.close()
    closed = time.monotonic() - started
    print(f"tp={tp} {variant}: close took {closed:.2f} s")
    assert closed < 10, "leaving the NCCL group hung (graphs must be released first)"
    del llm
    gc.collect()
    torch.cuda.empty_cache()  # the next engine's budget must not count this one's memory
    return g, s


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    """The checkpoint and, per variant, one GPU's tokens (each computed once for the TP=2 and TP=4 cases)."""
    path = make_checkpoint("llama", tmp_path_factory.mktemp("llama"), extra_vocab=3)
    done: dict[str, tuple[list, list]] = {}

    def get(variant: str) -> tuple[object, tuple[list, list]]:
        if variant not in done:
            done[variant] = _run(path, 1, variant)
        return path, done[variant]

    return get


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_parallel_on_gpus_matches_one_gpu(one_gpu, variant, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    path, (greedy_1, sampled_1) = one_gpu(variant)
    greedy_n, sampled_n = _run(path, tp, variant)
    assert greedy_n == greedy_1
    assert sampled_n == sampled_1
