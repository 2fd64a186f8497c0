"""The batched sampler's per-request adjustments and constraints on the GPU, inside the CUDA-graph and
async pipeline (issue 16): the same tokens as the CPU engine, float32, the embedded model.

Penalties, logit_bias, min_tokens, allowed_token_ids and bad words are applied on the device from rows
updated by each step's own samples; structured outputs arrive as masks in the plan.  On the CPU they are
checked against plain-torch references (tests/engine/test_logits_adjust.py); here the GPU engine must
agree with the CPU engine token for token, all requests batched together so that the rows of different
requests sit side by side in one sampling step.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from tests.engine.logits_probe import zen_prefixes

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}},
    "required": ["name", "count"],
}


def _params(stop: int, banned: str) -> dict[str, SamplingParams]:
    base = dict(temperature=0, max_tokens=24, ignore_eos=True)
    return {
        "plain": SamplingParams(**base),
        "frequency+presence": SamplingParams(**base, frequency_penalty=1.2, presence_penalty=0.8),
        "repetition": SamplingParams(**base, repetition_penalty=1.4),
        "logit_bias": SamplingParams(**base, logit_bias={stop: 6.0}),
        "min_tokens": SamplingParams(**base, min_tokens=20, stop_token_ids=[stop]),
        "bad_words": SamplingParams(**base, bad_words=[banned]),
        "regex": SamplingParams(
            temperature=0,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(regex="[a-z]{3,8}( [a-z]{2,6}){2,3}"),
        ),
        "json": SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    }


def _run(llm: LLM, prompts: list[str], params: dict[str, SamplingParams]) -> dict[str, list[list[int]]]:
    names = [n for n in params for _ in prompts]
    outs = llm.generate([p for _ in params for p in prompts], [params[n] for n in names], use_tqdm=False)
    got: dict[str, list[list[int]]] = {}
    for name, out in zip(names, outs):
        got.setdefault(name, []).append(list(out.outputs[0].token_ids))
    return got


@pytest.mark.gpu
def test_adjustments_and_constraints_on_the_gpu_equal_the_cpu_engine():
    prompts = zen_prefixes()[:4]
    with LLM(device="cpu", dtype="float32") as cpu:
        first = cpu.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        produced = [t for o in first for t in o.outputs[0].token_ids]
        stop = max(set(produced), key=produced.count)
        banned = cpu.get_tokenizer().decode([produced[2]]).strip() or "the"
        params = _params(stop, banned)
        want = _run(cpu, prompts, params)
    gpu = LLM(device="cuda", dtype="float32")  # CUDA graphs and the async pipeline: the defaults
    try:
        assert gpu.llm_engine.core.graph_capture_seconds > 0
        got = _run(gpu, prompts, params)
        texts = [o.outputs[0].text for o in gpu.generate(prompts, params["json"], use_tqdm=False)]
    finally:
        gpu.close()
        del gpu
        gc.collect()
        torch.cuda.empty_cache()
    same = {name: sum(a == b for a, b in zip(got[name], want[name])) for name in params}
    print("GPU == CPU per case (of 4 prompts):", same)
    assert got == want
    assert want["plain"] != want["frequency+presence"] and want["plain"] != want["repetition"]
    assert all(len(t) >= 20 or t[-1] != stop for t in got["min_tokens"])
    for text in texts:  # the schema holds whenever the object completed
        if text.rstrip().endswith("}"):
            obj = json.loads(text)
            assert set(obj) == {"name", "count"} and isinstance(obj["count"], int)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_rows_take_the_argmax_of_the_models_dtype_first_of_equals(dtype):
    """A plain greedy batch without logprobs skips the float32 copy: the same tokens, ties included."""
    from engine.runner.sampler import SamplingBatch, sample_on_device

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(256, 128256, device="cuda", generator=g).to(dtype)
    logits[:, 77] = logits.max(dim=-1).values  # a tie with each row's maximum: the first of equals wins
    logits[3] = 0  # every token equal
    batch = SamplingBatch(None, None, None, [None] * 256, True, True, False, -1)
    tokens = sample_on_device(logits, batch, torch.Generator(device="cuda")).to_host().token_ids
    assert tokens == logits.float().argmax(dim=-1).tolist()
    assert tokens[3] == 0 and all(t <= 77 for t in tokens)
