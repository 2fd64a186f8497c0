"""The vLLM-compatible offline API on the embedded model: sampling, stops, n, logprobs, errors."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.default_model import DEFAULT_MODEL_DIR
from engine.loop.llm_engine import RequestRejected
from engine.sampling_params import SamplingParamsError

ZEN = json.loads((DEFAULT_MODEL_DIR / "zen_prefixes.json").read_text())


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(block_size=8)


def _pool_empty(llm: LLM) -> bool:
    kv = llm.llm_engine.core.kv
    return kv.num_free_blocks == kv.num_blocks and kv.num_sequences() == 0


def test_the_issue_snippet_runs_unchanged(llm):
    outputs = llm.generate(
        ["The future of AI is", "Explain quantum computing"],
        SamplingParams(temperature=0.7, top_p=0.95, max_tokens=100),
    )
    assert [o.prompt for o in outputs] == ["The future of AI is", "Explain quantum computing"]
    for o in outputs:
        assert isinstance(o.outputs[0].text, str) and o.outputs[0].token_ids
        assert o.outputs[0].finish_reason in ("stop", "length")


def test_embedded_model_reproduces_its_training_text(llm):
    """Must-show 2: greedy decoding of every line's first words gives the rest of the line."""
    outs = llm.generate([z["prefix"] for z in ZEN], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    for z, o in zip(ZEN, outs):
        assert o.outputs[0].text == z["completion"], z["prefix"]
        assert o.outputs[0].finish_reason == "stop"  # it ends the line with EOS
    assert _pool_empty(llm)


def test_prompt_token_ids_are_accepted(llm):
    tok = llm.get_tokenizer()
    ids = tok(ZEN[0]["prefix"])["input_ids"]
    by_text, by_ids = llm.generate(
        [ZEN[0]["prefix"], {"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_ids.prompt_token_ids == ids


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    p = SamplingParams(temperature=1.5, top_k=50, top_p=0.95, max_tokens=20, seed=7, ignore_eos=True)
    alone = llm.generate(["Beautiful is"], p, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(
        ["Flat is", "Beautiful is", "Errors should"] * 3,
        [
            SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
            p,
            SamplingParams(temperature=0.5, max_tokens=5),
        ]
        * 3,
        use_tqdm=False,
    )
    for o in crowd[1::3]:
        assert o.outputs[0].token_ids == alone


def test_n_sequences_equal_separately_seeded_requests(llm):
    p = SamplingParams(n=4, temperature=2.0, max_tokens=12, seed=100, ignore_eos=True)
    together = llm.generate(["Simple is"], p, use_tqdm=False)[0]
    assert [c.index for c in together.outputs] == [0, 1, 2, 3]
    for i, c in enumerate(together.outputs):
        alone = llm.generate(
            ["Simple is"], SamplingParams(temperature=2.0, max_tokens=12, seed=100 + i, ignore_eos=True), use_tqdm=False
        )[0]
        assert c.token_ids == alone.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in together.outputs}) > 1  # really sampled


def test_top_k_1_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate(["Sparse is"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    for p in (
        SamplingParams(temperature=1.0, top_k=1, max_tokens=8, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, seed=1),
    ):
        assert llm.generate(["Sparse is"], p, use_tqdm=False)[0].outputs[0].token_ids == greedy.outputs[0].token_ids


def test_logprobs_are_the_models_log_softmax(llm):
    out = llm.generate(["Readability"], SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    total = 0.0
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and entry[tok].logprob <= 0
        assert len(entry) == 3  # greedy: the chosen token is the top-1
        total += entry[tok].logprob
    assert math.isclose(c.cumulative_logprob, total, rel_tol=1e-6)
    # Check the first against a direct forward pass of transformers.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR)).float().eval()
    with torch.inference_mode():
        lp = torch.log_softmax(hf(torch.tensor([out.prompt_token_ids])).logits[0, -1].float(), -1)
    assert math.isclose(c.logprobs[0][c.token_ids[0]].logprob, lp[c.token_ids[0]].item(), rel_tol=1e-4)


def test_stop_strings_stop_tokens_max_tokens_and_eos(llm):
    line = next(z for z in ZEN if z["prefix"].startswith("Beautiful"))
    full = llm.generate([line["prefix"]], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "stop" and full.stop_reason is None  # EOS
    assert full.token_ids[-1] in llm.llm_engine.core.eos_token_ids

    stop_word = full.text.split()[1]  # e.g. "than"
    o = llm.generate([line["prefix"]], SamplingParams(temperature=0, max_tokens=30, stop=[stop_word]), use_tqdm=False)[
        0
    ].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop_word
    assert o.text == full.text[: full.text.index(stop_word)]
    o = llm.generate(
        [line["prefix"]],
        SamplingParams(temperature=0, max_tokens=30, stop=stop_word, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert o.text.endswith(stop_word)

    o = llm.generate(
        [line["prefix"]],
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[full.token_ids[1]]),
        use_tqdm=False,
    )[0].outputs[0]
    assert o.stop_reason == full.token_ids[1] and o.token_ids == full.token_ids[:2]

    o = llm.generate([line["prefix"]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 2

    o = llm.generate(
        [line["prefix"]],
        SamplingParams(temperature=0, max_tokens=len(full.token_ids) + 5, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == len(full.token_ids) + 5
    assert _pool_empty(llm)


def test_requests_that_can_never_fit_are_rejected_at_admission(llm):
    limit = llm.llm_engine.max_model_len
    with pytest.raises(RequestRejected) as e:
        llm.generate([{"prompt_token_ids": [5] * (limit - 3)}], SamplingParams(max_tokens=10), use_tqdm=False)
    assert e.value.param == "max_tokens" and "max_model_len" in str(e.value)
    with pytest.raises(RequestRejected):
        llm.generate([""], SamplingParams(), use_tqdm=False) if not llm.get_tokenizer()("")[
            "input_ids"
        ] else llm.generate([{"prompt_token_ids": []}], SamplingParams(), use_tqdm=False)
    with pytest.raises(RequestRejected):
        llm.generate([{"prompt_token_ids": [10**9]}], SamplingParams(), use_tqdm=False)
    # max_tokens=None means "up to max_model_len"
    o = llm.generate(["Flat is"], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == limit
    assert _pool_empty(llm)


@pytest.mark.parametrize(
    "bad,param",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(logprobs=50), "logprobs"),
    ],
)
def test_bad_sampling_params_name_the_parameter(bad, param):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**bad)
    assert e.value.param == param


def test_aborts_return_every_block(llm):
    engine = llm.llm_engine
    for i in range(6):
        engine.add_request(f"a{i}", "Now is better", SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    kv = engine.core.kv
    assert kv.num_free_blocks < kv.num_blocks
    for i in range(0, 6, 2):
        out = engine.abort_request(f"a{i}")
        assert out.finished and all(c.finish_reason == "abort" for c in out.outputs)
    assert engine.abort_request("a0") is None  # already gone
    while engine.has_unfinished_requests():
        engine.step()
    assert _pool_empty(llm)


def test_configuration_errors_are_clear(tmp_path, checkpoint):
    with pytest.raises(ConfigError, match="no such directory"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="not supported; supported: .*LlamaForCausalLM"):
        LLM(str(tmp_path))
    with pytest.raises(ConfigError, match="--block-size"):
        LLM(block_size=12)
    with pytest.raises(ConfigError, match="unknown engine option"):
        LLM(blok_size=16)
    with pytest.raises(ConfigError, match="--max-model-len 100000 exceeds"):
        LLM(max_model_len=100000)
    with pytest.raises(ConfigError, match="needs .* blocks"):
        LLM(max_model_len=256, kv_cache_memory_bytes=4096)
    with pytest.raises(ConfigError, match="--tensor-parallel-size 3 does not divide the model's 4 attention heads"):
        LLM(tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="--tensor-parallel-size 8 does not divide"):
        LLM(tensor_parallel_size=8)
    with pytest.raises(ConfigError, match="--device cuda:1 with --tensor-parallel-size 2: rank r uses cuda:r"):
        LLM(tensor_parallel_size=2, device="cuda:1")


def test_best_of_other_than_n_is_refused_by_name_not_ignored():
    from engine.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="best_of is not supported yet") as e:
        SamplingParams(best_of=4)
    assert e.value.param == "best_of"
    # the "off" values, as programs written for vLLM pass them
    SamplingParams(presence_penalty=0.0, repetition_penalty=1.0, min_tokens=0, min_p=0.0, logit_bias={}, best_of=1)
    SamplingParams(n=3, best_of=3)


def test_the_served_name_of_the_embedded_model_is_a_model_name_too():
    llm = LLM("pagekeeper-default")
    assert llm.llm_engine.config.model_name() == "pagekeeper-default"
    out = llm.generate("Now is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out[0].outputs[0].text == " better than never."


def test_structured_outputs_offline_as_in_vllm():
    from engine.loop.llm_engine import RequestRejected
    from engine.sampling_params import StructuredOutputsParams

    llm = LLM("pagekeeper-default")
    params = SamplingParams(temperature=1.0, max_tokens=20, n=3, seed=0)
    params.structured_outputs = StructuredOutputsParams(regex=r"[0-9]{3}\.[a-z]{2}")
    texts = [c.text for c in llm.generate("Now is", params, use_tqdm=False)[0].outputs]
    print(f"regex outputs: {texts}")
    assert all(re.fullmatch(r"[0-9]{3}\.[a-z]{2}", t) for t in texts)
    with pytest.raises(RequestRejected, match="cannot be compiled") as e:
        llm.generate("Now is", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), use_tqdm=False)
    assert e.value.param == "structured_outputs"


def test_truncate_prompt_tokens_keeps_the_last_tokens_offline():
    llm = LLM("pagekeeper-default")
    ids = list(llm.get_tokenizer()("Errors should never pass silently. Now is")["input_ids"])
    params = SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=4)
    cut = llm.generate("Errors should never pass silently. Now is", params, use_tqdm=False)[0]
    same = llm.generate({"prompt_token_ids": ids[-4:]}, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-4:] and cut.prompt is None
    assert cut.outputs[0].token_ids == same.outputs[0].token_ids
