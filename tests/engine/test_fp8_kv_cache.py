"""--kv-cache-dtype fp8 through the engine on the CPU (the torch path): accuracy against the model's own
cache, the memory it frees (budget, swap space, the plan), preemption by swap, the calibrated scales,
and the refusals.

Accuracy is measured on the embedded model (trained: it predicts the Zen of Python), teacher-forced
over its text: every position's logits through the decode path (each token reads all earlier ones
from the fp8 cache) and through one prefill, then greedy continuations of its 19 prefixes.
"""

from __future__ import annotations

import gc

import pytest
import torch

from engine import LLM
from engine.config import ConfigError, EngineConfig
from engine.model.layers.attention import PagedAttention
from engine.runner.kv_scales import HEADROOM, scales_from_amax
from tests.engine.logits_probe import agreement, engine_logits, greedy, logit_error, zen_prefixes, zen_text

# Stated bounds: the largest logit difference within 6 % of the largest logit (e4m3 keeps 3 mantissa
# bits: one stored K/V element is within 1/16 of its value), the argmax at >= 95 % of positions, and
# >= 90 % of greedy tokens unchanged.
MAX_REL_LOGIT_ERROR = 0.06
MIN_ARGMAX_AGREEMENT = 0.95
MIN_GREEDY_AGREEMENT = 0.90


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_cache_logits_and_greedy_tokens_stay_close_to_the_models_own_cache(dtype):
    base = LLM(None, dtype=dtype)
    fp8 = LLM(None, dtype=dtype, kv_cache_dtype="fp8")
    assert fp8.llm_engine.core.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    ids = base.get_tokenizer()(zen_text())["input_ids"][:200]
    for n, chunk in ((64, 1), (200, 200)):  # every token through the decode path; one prefill
        err = logit_error(engine_logits(fp8, ids[:n], chunk), engine_logits(base, ids[:n], chunk))
        print(f"fp8 KV cache, {dtype} model, {n} tokens, chunk {chunk}: {err}")
        assert err["max_rel"] <= MAX_REL_LOGIT_ERROR and err["argmax_agree"] >= MIN_ARGMAX_AGREEMENT, err
    prompts = zen_prefixes()
    rate, identical = agreement(greedy(fp8, prompts), greedy(base, prompts))
    print(f"fp8 KV cache, {dtype} model: greedy token agreement {rate:.3f}, {identical}/{len(prompts)} identical")
    assert rate >= MIN_GREEDY_AGREEMENT


def test_fp8_cache_holds_twice_the_tokens_in_the_same_bytes():
    """The budget, the swap space and the plan count one byte per element."""
    kw = dict(dtype="bfloat16", kv_cache_memory_bytes=8 << 20, swap_space=1 / 256, preemption_mode="swap")
    auto, fp8 = LLM(None, **kw).llm_engine.core, LLM(None, kv_cache_dtype="fp8", **kw).llm_engine.core
    assert fp8.kv_plan.bytes_per_block * 2 == auto.kv_plan.bytes_per_block
    assert fp8.kv.num_blocks == 2 * auto.kv.num_blocks and fp8.kv.num_cpu_blocks == 2 * auto.kv.num_cpu_blocks
    table = fp8.kv_plan.table()
    assert "float8_e4m3fn, 512 bytes/token" in table and "bfloat16, 1024 bytes/token" in auto.kv_plan.table()
    cpu = fp8.runner.cpu_caches[0]
    assert cpu.dtype == torch.float8_e4m3fn
    print(f"8 MiB of KV: {auto.kv.num_blocks} blocks bf16, {fp8.kv.num_blocks} fp8; swap {fp8.kv.num_cpu_blocks} fp8")


def test_fp8_cache_survives_preemption_by_swap():
    """A pool that holds one long request: sequences are swapped out to CPU fp8 blocks and back, and
    the tokens equal an unpreempted fp8 run."""
    prompts = zen_prefixes()[:6]
    roomy = LLM(None, kv_cache_dtype="fp8", block_size=8, max_model_len=64)
    per_block = roomy.llm_engine.core.kv_plan.bytes_per_block
    tight = LLM(
        None,
        kv_cache_dtype="fp8",
        block_size=8,
        max_model_len=64,
        kv_cache_memory_bytes=10 * per_block,
        preemption_mode="swap",
        swap_space=64 * per_block / 2**30,
    )
    want, got = greedy(roomy, prompts, 40), greedy(tight, prompts, 40)
    core = tight.llm_engine.core
    print(f"fp8 swap: {core.scheduler.num_preemptions} preemptions, {core.kv.blocks_swapped_out} blocks swapped out")
    assert core.kv.blocks_swapped_out > 0 and got == want


def test_scales_are_per_head_powers_of_two_with_headroom():
    amax = torch.tensor([[0.0, 1.0, 6.6], [448.0, 1e-4, 3000.0]])
    s = scales_from_amax(amax)
    assert s[0, 0] == 1.0  # a head that wrote nothing
    assert torch.equal(torch.log2(s), torch.log2(s).round())
    live = amax > 0
    assert bool((amax[live] * HEADROOM / s[live] <= 448).all()) and bool((amax[live] * HEADROOM / s[live] > 224).all())
    llm = LLM(None, kv_cache_dtype="fp8")
    layers = [m for m in llm.llm_engine.core.model.modules() if isinstance(m, PagedAttention)]
    scales = torch.stack([m.kv_scale for m in layers])
    assert scales.shape == (4, 2, 2) and torch.equal(torch.log2(scales), torch.log2(scales).round())
    print(f"calibrated scales (layer, K/V, head): log2 {torch.log2(scales).int().flatten().tolist()}")


def test_unsupported_kv_cache_dtypes_and_devices_are_refused_in_one_line(monkeypatch):
    with pytest.raises(ConfigError) as e:
        EngineConfig(kv_cache_dtype="fp8_e5m2")  # type: ignore[arg-type]
    assert "\n" not in str(e.value) and "--kv-cache-dtype" in str(e.value)
    from engine.model.quant import check_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError) as e:
        check_device(EngineConfig(device="cuda", kv_cache_dtype="fp8"), None)
    print(f"refused: {e.value}")
    assert "\n" not in str(e.value) and "compute capability 8.9" in str(e.value) and "A100" in str(e.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_device(EngineConfig(device="cuda", kv_cache_dtype="fp8"), None)  # Hopper: accepted


@pytest.mark.gpu
def test_gpu_quantized_engines_match_the_cpu_reference_path():
    """The embedded model on the GPU (Triton kernels, torch._scaled_mm) against the CPU (torch reference)
    for each quantization: the same greedy tokens, logits within float32 kernel noise."""
    import json as _json
    import tempfile
    from pathlib import Path

    from engine.default_model import DEFAULT_MODEL_DIR
    from engine.model.quantize import write_awq

    awq = write_awq(DEFAULT_MODEL_DIR, Path(tempfile.mkdtemp()) / "awq", 128)
    prompts = zen_prefixes()
    for model, kw in (
        (None, dict(kv_cache_dtype="fp8", dtype="float32")),
        (None, dict(kv_cache_dtype="fp8", dtype="bfloat16")),
        (None, dict(quantization="fp8", dtype="bfloat16")),
        (str(awq), dict(dtype="float16")),
    ):
        if (kw.get("quantization") == "fp8" or "kv_cache_dtype" in kw) and torch.cuda.get_device_capability() < (8, 9):
            continue
        with LLM(model, device="cpu", **kw) as cpu:
            want = greedy(cpu, prompts)
        gpu = LLM(model, device="cuda", **kw)
        try:
            rate, identical = agreement(greedy(gpu, prompts), want)
        finally:  # the next configuration profiles the GPU's free memory: this one must be gone
            gpu.close()
            del gpu
            gc.collect()
            torch.cuda.empty_cache()
        print(f"gpu vs cpu {_json.dumps(kw)}: greedy {rate:.3f} ({identical}/19 identical)")
        assert rate >= 0.9
