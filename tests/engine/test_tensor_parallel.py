"""Tensor parallelism on CPU (gloo, real worker processes): token-identical to one rank and to transformers.

Each case runs the offline API with chunked prefill (a 40-token step budget splits the prompts),
prefix caching (three prompts share a 40-token prefix) and a KV pool so small that the scheduler
must preempt, at --tensor-parallel-size 1 and N, and compares greedy tokens with transformers'
generate on the same checkpoint.  The cases cover an even KV-head split, KV heads replicated
(fewer KV heads than ranks: llama at 4, qwen3 at 2), q/k/v biases (qwen2), OPT, and a vocabulary
that does not divide by the ranks (padding).  Seeded random sampling must match one rank too.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from tests.checkpoints import make_checkpoint

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
LENGTHS = (1, 7, 17, 33, 64, 90)
BLOCK = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            arch, extra = (name.split("+") + ["0"])[:2]
            path = make_checkpoint(arch, tmp_path_factory.mktemp(name.replace("+", "_")), extra_vocab=int(extra))
            made[name] = (path, _reference(path))
        return made[name]

    return get


@pytest.fixture(scope="module")
def one_rank(models):
    """one_rank(name) -> the greedy and seeded-sampled tokens of one rank (the same engine for every case of a model:
    llama+3's was built three times, for TP 2, TP 4 and the overlap)."""
    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            path, (prompts, _, cfg) = models(name)
            one = _engine(path, cfg, 1)
            try:
                made[name] = _run(one, prompts)
            finally:
                one.close()
        return made[name]

    return get


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in LENGTHS]
    shared = prompts[-1][:40]
    return prompts + [shared + [rng.randrange(vocab) for _ in range(k)] for k in (3, 11)]


def _reference(path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path)).float().eval()
    prompts = _prompts(384)  # ids the tokenizer knows, also for the padded vocabularies
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
            expected.append(out[0, len(p) :].tolist())
    return prompts, expected, hf.config


def _bytes_per_block(cfg, tp: int) -> int:
    """One rank's KV bytes per block: its KV heads (an even share, or one replicated head), float32."""
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * cfg.num_hidden_layers * max(1, kv // tp) * head_dim * BLOCK * 4


def _engine(path, cfg, tp: int, **extra) -> LLM:
    """A KV pool per rank that holds the longest request alone and little more: the batch must preempt."""
    blocks = -(-(max(LENGTHS) + MAX_TOKENS) // BLOCK) + 2
    llm = LLM(
        str(path),
        tensor_parallel_size=tp,
        max_model_len=128,
        block_size=BLOCK,
        enable_chunked_prefill=True,
        max_num_batched_tokens=40,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=blocks * _bytes_per_block(cfg, tp),
        seed=11,
        **extra,
    )
    assert llm.llm_engine.core.kv.num_blocks == blocks
    return llm


# Every rank keeps its own device rows of output counts from its own samples: they must agree.
ADJUST = [
    {"structured_outputs": StructuredOutputsParams(regex="[a-z]{4,12}( [a-z]{2,8}){1,3}")},  # the mask is in the plan
    {"repetition_penalty": 1.3, "frequency_penalty": 0.5},
    {"presence_penalty": 1.0, "min_p": 0.05, "logit_bias": {7: 2.0}},
    {"allowed_token_ids": list(range(0, 300, 3)), "min_tokens": 4},
]


def _run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    greedy = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    sampled = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:4]],
        [
            SamplingParams(temperature=0.9, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True, seed=i, **ADJUST[i])
            for i in range(4)
        ],
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in greedy], [o.outputs[0].token_ids for o in sampled]


CASES = [
    ("llama+3", 2),  # 2 KV heads split evenly; vocabulary 387 padded to 388
    ("llama+3", 4),  # 4 query heads, 2 KV heads replicated on 2 ranks each; vocabulary padded to 388
    ("qwen3", 2),  # 1 KV head replicated; q/k norms
    ("qwen2", 2),  # q/k/v biases
    ("opt", 2),
]


@pytest.mark.parametrize("name,tp", CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_tensor_parallel_matches_one_rank_and_transformers(models, one_rank, name, tp):
    path, (prompts, expected, cfg) = models(name)
    greedy_1, sampled_1 = one_rank(name)
    llm = _engine(path, cfg, tp)
    try:
        core = llm.llm_engine.core
        greedy_n, sampled_n = _run(llm, prompts)
        preemptions, hits = core.scheduler.num_preemptions, core.kv.prefix_hits
        ranks = len(core.memory_plans)
    finally:
        llm.close()
    print(f"{name} tp={tp}: {len(prompts)} prompts, preemptions={preemptions}, prefix hits={hits}, ranks={ranks}")
    assert greedy_1 == expected, "one rank differs from transformers"
    assert greedy_n == expected, f"--tensor-parallel-size {tp} differs from transformers"
    assert sampled_n == sampled_1, "seeded sampling differs between 1 and N ranks"
    assert preemptions > 0 and hits > 0 and ranks == tp


def test_overlapped_micro_batches_match_one_rank_and_switch_on_every_rank(models, one_rank):
    """--tensor-parallel-overlap-tokens (engine/model/overlap.py) over gloo: started with a threshold no step
    reaches (the plain steps), then switched to 2 tokens on every rank between two generate calls, so that every
    step of two or more tokens (chunks, mixed steps, decodes of several sequences) runs as two micro-batches.  A
    rank that missed the switch would issue other all-reduces than its peer and the step would fail."""
    path, (prompts, expected, cfg) = models("llama+3")
    greedy_1, sampled_1 = one_rank("llama+3")
    llm = _engine(path, cfg, 2, tensor_parallel_overlap_tokens=1 << 20)
    try:
        runner = llm.llm_engine.core.runner
        model = runner.local.model
        plain = _run(llm, prompts)
        assert model.overlapped_steps == 0
        runner.set_overlap_tokens(2)
        split = _run(llm, prompts)
        steps = model.overlapped_steps
    finally:
        llm.close()
    print(f"overlapped forwards on rank 0: {steps}")
    assert greedy_1 == expected and plain[0] == expected
    assert split[0] == expected, "the overlapped steps' greedy tokens differ from transformers"
    assert split[1] == sampled_1, "seeded sampling with overlapped steps differs from one rank"
    assert steps > 20


def test_a_start_up_that_cannot_fit_says_why_and_stops_every_rank(tmp_path):
    """Rank 0's start-up error reaches the caller as it is (the table of what took the memory, what to change), not
    as a failure of the clean-up it triggers, and the workers are gone afterwards."""
    import psutil

    from engine.config import ConfigError

    path = make_checkpoint("llama", tmp_path / "llama")
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError, match="holds 0 blocks") as err:
        LLM(str(path), tensor_parallel_size=2, max_model_len=128, block_size=BLOCK, kv_cache_memory_bytes=1)
    print(str(err.value).splitlines()[0])
    assert "Change:" in str(err.value)
    left = [c for c in psutil.Process().children(recursive=True) if c.pid not in before and c.is_running()]
    gone, alive = psutil.wait_procs(left, timeout=30)
    print(f"worker processes left running after the error: {len(left)}, of which still alive after 30 s: {len(alive)}")
    assert not alive
