"""Issue 6: decode steps replay CUDA graphs (padded to a capture size) and give exactly the tokens of
the eager path, synchronous or pipelined; the graphs' pool is in the memory plan; eager stays eager."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runner.cuda_graphs import capture_sizes, padded_size


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and capture_sizes(256)[-1] == 256
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]
    assert capture_sizes(1000)[-1] == 512


def test_padded_sizes_are_the_captured_ones_then_multiples_of_64():
    sizes = capture_sizes(256)
    # every count up to 256 lands on a captured size, never below the count: the LM head of an eager step meets
    # only the row counts the graphs (and warm_lm_head) met, so cuBLAS never waits on a new shape mid-serving
    padded = {padded_size(n, sizes) for n in range(1, 257)}
    assert padded == set(sizes)
    assert all(padded_size(n, sizes) >= n for n in range(1, 600))
    assert padded_size(257, sizes) == 320 and padded_size(321, sizes) == 384
    assert padded_size(37, []) == 37  # off CUDA nothing is padded


def test_a_batch_whose_graph_is_not_captured_yet_replays_the_smallest_captured_one_that_holds_it():
    """While the captures are deferred (a restart's first steps), a batch of 8 with only the 16 graph captured
    replays it padded rather than running eagerly; past every captured size it runs eagerly."""
    from engine.runner.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs()
    graphs.planned = [1, 2, 4, 8, 16, 32]
    assert graphs.size_for(8) is None  # nothing captured: eager
    graphs.graphs, graphs.sizes = {16: None}, [16]  # type: ignore[dict-item]
    assert graphs.size_for(8) == 16 and graphs.size_for(9) == 16 and graphs.size_for(1) == 16
    assert graphs.size_for(17) is None and graphs.size_for(40) is None
    graphs.graphs, graphs.sizes = {8: None, 16: None}, [8, 16]  # type: ignore[dict-item]
    assert graphs.size_for(5) == 8 and graphs.size_for(8) == 8  # its own padded size once captured


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int = 20) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs]


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager(arch, dtype, checkpoint):
    rng = random.Random(5)
    common = dict(device="cuda", dtype=dtype, max_model_len=256, max_num_seqs=48, kv_cache_memory_bytes=64 << 20)
    eager = LLM(str(checkpoint(arch)), enforce_eager=True, max_num_on_the_fly_batches=1, **common)
    vocab = eager.llm_engine.core.model_info.hf_config.vocab_size
    batches = {
        n: [[rng.randrange(vocab) for _ in range(rng.randrange(1, 120))] for _ in range(n)] for n in (1, 3, 17, 41)
    }  # 3 -> graph 4, 17 -> 32, 41 -> 48: padding rows every time
    expected = {n: _run(eager, p) for n, p in batches.items()}
    assert eager.llm_engine.core.runner.graphs is None
    del eager
    _free()
    for depth in (1, 2):
        llm = LLM(str(checkpoint(arch)), max_num_on_the_fly_batches=depth, **common)
        core = llm.llm_engine.core
        assert core.runner.graphs is not None and core.runner.graphs.sizes[-1] == 48
        assert core.kv_plan.graph_bytes and core.kv_plan.graph_bytes > 0
        replays = _count_replays(core.runner.graphs)
        for n, prompts in batches.items():
            assert _run(llm, prompts) == expected[n], (depth, n)
        assert replays() > 0
        kv = core.kv
        assert kv.num_free_blocks == kv.num_blocks  # padding rows wrote no KV, took no block
        del llm, core, kv
        _free()


def _count_replays(graphs):
    count = [0]
    original = graphs.replay

    def counting(size: int):
        count[0] += 1
        return original(size)

    graphs.replay = counting
    return lambda: count[0]


@pytest.mark.gpu
def test_graph_memory_is_in_the_plan_and_steady_state_allocates_nothing(checkpoint):
    llm = LLM(
        str(checkpoint("llama")),
        device="cuda",
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=64,
        gpu_memory_utilization=0.3,
    )
    plan = llm.llm_engine.core.kv_plan
    assert "CUDA graphs" in plan.table() and plan.graph_bytes > 0
    prompts = [[7 + i] * (5 + i) for i in range(40)]
    _run(llm, prompts)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    for _ in range(3):
        _run(llm, prompts)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() == reserved
    del llm
    _free()


@pytest.mark.gpu
def test_graphs_captured_under_load_replay_at_once_wanted_size_first_and_change_no_token(checkpoint, monkeypatch):
    """A server captures its decode graphs one per step while requests run (engine/runner/deferred.py): the size the
    current batch needs first, each replayed from its capture on.  float32: the tokens equal the eager ones."""
    from engine.config import EngineConfig
    from engine.core import engine_core
    from engine.loop.llm_engine import LLMEngine
    from engine.runner.cuda_graphs import DecodeGraphs

    rng = random.Random(11)
    common = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=48, kv_cache_memory_bytes=64 << 20)
    eager = LLM(str(checkpoint("llama")), enforce_eager=True, **common)
    vocab = eager.llm_engine.core.model_info.hf_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(17)]  # 17 -> graph 32
    expected = _run(eager, prompts, max_tokens=24)
    del eager
    _free()

    replayed: list[tuple[int, int]] = []  # (size, graphs captured at the time)
    original = DecodeGraphs.replay

    def counting(self, size):  # type: ignore[no-untyped-def]
        replayed.append((size, len(self.graphs)))
        return original(self, size)

    monkeypatch.setattr(DecodeGraphs, "replay", counting)
    monkeypatch.setattr(engine_core, "DEFERRED_AFTER_LOAD_S", 3600.0)  # only the graphs run under load
    monkeypatch.setattr(engine_core, "DEFERRED_GAP_S", 0.0)
    monkeypatch.setattr(engine_core, "DEFERRED_SHARE", 1.0)  # one capture per step
    engine = LLMEngine(EngineConfig(model=str(checkpoint("llama")), **common), defer_startup_work=True)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    out: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[int(o.request_id)] = list(o.outputs[0].token_ids)
    graphs = engine.core.runner.graphs
    assert graphs is not None and graphs.planned[-1] == 48
    # the batch's size is captured first: the unit that runs before the first step goes by that step's batch (it
    # captured the largest graph, the slowest to capture, and a restart's first decodes ran eagerly meanwhile)
    assert replayed and replayed[0][0] == 32 and replayed[0][1] == 1, f"the wanted size came late: {replayed[:3]}"
    assert replayed[0][1] < len(graphs.planned), "every graph was captured before the first replay"
    assert [out[i] for i in range(len(prompts))] == expected
    kv = engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks
    del engine, kv, graphs
    _free()
