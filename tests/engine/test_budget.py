"""The KV budget: the profiled formula with its fragmentation buffer, the plan table, the refusal
of a max_model_len that cannot fit, and the profiling step itself (run here on the CPU)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig, ResolvedConfig
from engine.memory.budget import MIN_FRAGMENTATION_BUFFER, DeviceBaseline, Profile, plan_kv_cache
from engine.runner.startup import dummy_step

GIB = 2**30
CUDA = torch.device("cuda")


def _config(**kw) -> ResolvedConfig:
    return EngineConfig(**kw).resolve(4096)


def test_profiled_budget_subtracts_weights_activations_others_and_the_buffer():
    baseline = DeviceBaseline(total_bytes=80 * GIB, used_before_bytes=2 * GIB)  # another process + context
    profile = Profile(
        weights_bytes=16 * GIB,
        peak_allocated_bytes=20 * GIB,
        peak_reserved_bytes=21 * GIB,
        activation_bytes=3 * GIB,
        non_torch_bytes=1 * GIB,
    )
    per_block = 2 * 32 * 8 * 16 * 128 * 2  # Llama-3-8B, bf16, block 16: 2 MiB
    plan = plan_kv_cache(
        _config(gpu_memory_utilization=0.9, fragmentation_buffer_factor=2.0), per_block, CUDA, baseline, profile
    )
    buffer = 2 * GIB  # factor 2 x (21 - 20) GiB fragmentation
    expected = int(80 * GIB * 0.9) - 2 * GIB - 16 * GIB - 3 * GIB - buffer
    assert plan.fragmentation_buffer_bytes == buffer
    assert plan.num_blocks == expected // per_block and plan.kv_bytes <= expected
    assert plan.num_tokens == plan.num_blocks * 16
    assert plan.max_concurrency == pytest.approx(plan.num_blocks / 256)
    table = plan.table()
    for label in (
        "device memory",
        "weights",
        "peak activations",
        "fragmentation buffer",
        "KV tokens",
        "max concurrency",
    ):
        assert label in table


def test_the_buffer_never_goes_below_150_mib():
    baseline = DeviceBaseline(total_bytes=80 * GIB, used_before_bytes=GIB)
    tight = Profile(
        weights_bytes=GIB,
        peak_allocated_bytes=2 * GIB,
        peak_reserved_bytes=2 * GIB,
        activation_bytes=GIB // 2,
        non_torch_bytes=0,
    )
    plan = plan_kv_cache(_config(), 2**20, CUDA, baseline, tight)
    assert plan.fragmentation_buffer_bytes == MIN_FRAGMENTATION_BUFFER


def test_a_max_model_len_that_cannot_fit_is_refused_with_numbers_and_flags():
    baseline = DeviceBaseline(total_bytes=24 * GIB, used_before_bytes=GIB)
    profile = Profile(
        weights_bytes=20 * GIB,
        peak_allocated_bytes=21 * GIB,
        peak_reserved_bytes=21 * GIB,
        activation_bytes=GIB,
        non_torch_bytes=0,
    )
    with pytest.raises(ConfigError) as e:
        plan_kv_cache(_config(max_model_len=4096, gpu_memory_utilization=0.9), 2 * 2**20, CUDA, baseline, profile)
    msg = str(e.value)
    assert "--max-model-len 4096 needs 256 blocks" in msg and "weights" in msg
    assert "--gpu-memory-utilization" in msg and "quantized" in msg
    assert len(msg.splitlines()) < 25  # one screen


def test_kv_cache_memory_bytes_overrides_everything():
    plan = plan_kv_cache(_config(kv_cache_memory_bytes=300 * 2**20), 2**20, torch.device("cpu"))
    assert plan.num_blocks == 300 and plan.source == "--kv-cache-memory-bytes"


def test_dummy_weights_need_no_checkpoint_and_the_profiling_step_runs():
    llm = LLM(load_format="dummy", max_model_len=128, max_num_batched_tokens=300, kv_cache_memory_bytes=1 << 22)
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4
    core = llm.llm_engine.core
    dummy_step(core.config, core.model_info, core.model, core.device)  # 300 tokens as 128 + 128 + 44, throwaway cache
    kv = llm.llm_engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks
