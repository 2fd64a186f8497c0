"""Must-show 5: on CUDA the engine runs the Triton kernels, and its greedy tokens equal both the torch
reference path's on the same GPU (float32) and transformers' generate.

Prompts of many lengths (1 .. 90 tokens) run as one batch, with chunked prefill on a small token
budget (so prompt chunks extend earlier blocks and share steps with decodes: the prefill kernel's
mixed batches) and off (whole prefills, then pure decode steps: the decode kernel).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.layers.attention import PagedAttention

MAX_TOKENS = 24
PROMPT_LENGTHS = (1, 3, 7, 8, 16, 17, 33, 50, 64, 90)

SETTINGS = {
    "bs8-chunked": dict(block_size=8, enable_chunked_prefill=True, max_num_batched_tokens=40),
    "bs16-chunked": dict(block_size=16, enable_chunked_prefill=True, max_num_batched_tokens=40),
    "bs32-chunked": dict(block_size=32, enable_chunked_prefill=True, max_num_batched_tokens=40),
    "bs16-unchunked": dict(block_size=16, enable_chunked_prefill=False),
}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs]


def _set_backend(llm: LLM, backend) -> None:
    for m in llm.llm_engine.core.model.modules():
        if isinstance(m, PagedAttention):
            m.backend = backend
    llm.llm_engine.core.runner.graphs = None  # captured graphs hold the Triton kernels: run eagerly
    llm.llm_engine.core.runner.pieces = None


@pytest.fixture(scope="module")
def hf_greedy(checkpoint):
    """transformers' greedy continuations on the GPU, float32, per architecture."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(arch: str):
        if arch not in cache:
            hf = AutoModelForCausalLM.from_pretrained(str(checkpoint(arch))).float().cuda().eval()
            prompts = _prompts(hf.config.vocab_size)
            expected = []
            with torch.inference_mode():
                for p in prompts:
                    ids = torch.tensor([p], device="cuda")
                    out = hf.generate(
                        ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
                    )
                    expected.append(out[0, len(p) :].tolist())
            cache[arch] = (prompts, expected)
            del hf
            gc.collect()
            torch.cuda.empty_cache()
        return cache[arch]

    return get


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_engine_on_gpu_uses_triton_and_matches_reference_and_transformers(arch, setting, checkpoint, hf_greedy):
    from kernels import reference, triton_backend

    prompts, expected = hf_greedy(arch)
    llm = LLM(
        str(checkpoint(arch)),
        device="cuda",
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        **SETTINGS[setting],
    )
    try:
        core = llm.llm_engine.core
        assert core.device.type == "cuda"
        attn = [m for m in core.model.modules() if isinstance(m, PagedAttention)]
        assert attn and all(m.backend is triton_backend for m in attn)
        assert all(c.is_cuda for c in core.runner.kv_caches)

        triton_tokens = _greedy(llm, prompts)
        _set_backend(llm, reference)
        reference_tokens = _greedy(llm, prompts)
        assert triton_tokens == reference_tokens
        assert triton_tokens == expected
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_engine_on_gpu_with_the_default_memory_budget(checkpoint):
    """No --kv-cache-memory-bytes: the CUDA budget path sizes the pool from free GPU memory."""
    llm = LLM(str(checkpoint("llama")), device="cuda", dtype="float32", max_model_len=256, gpu_memory_utilization=0.3)
    try:
        out = llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
        )
        assert len(out[0].outputs[0].token_ids) == 8
        assert llm.llm_engine.core.kv_plan.source.startswith("--gpu-memory-utilization")
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
