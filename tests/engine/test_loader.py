"""Checkpoint loading: sharded safetensors, dtypes (auto follows the checkpoint), Mistral's window,
and clear errors for checkpoints that do not match their config."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.model.weights import ModelLoadError
from tests.checkpoints import TOKENIZER_FILES

PROMPT = {"prompt_token_ids": [5, 17, 99, 3, 250, 41, 7]}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _copy_tokenizer(src, dst):
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def test_sharded_checkpoint_loads_like_the_single_file(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    single = checkpoint("llama")
    hf = AutoModelForCausalLM.from_pretrained(str(single))
    hf.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="40KB")
    _copy_tokenizer(single, tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    assert _tokens(LLM(str(tmp_path))) == _tokens(LLM(str(single)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(checkpoint, dtype):
    ref = LLM(str(checkpoint("qwen2")), max_model_len=128)
    half = LLM(str(checkpoint("qwen2")), max_model_len=128, dtype=dtype)
    assert half.llm_engine.core.model_info.dtype == getattr(torch, dtype)
    assert half.llm_engine.core.runner.kv_caches[0].dtype == getattr(torch, dtype)
    p = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    a = ref.generate([PROMPT], p, use_tqdm=False)[0].outputs[0].logprobs[0]
    b = half.generate([PROMPT], p, use_tqdm=False)[0].outputs[0].logprobs[0]
    common = set(a) & set(b)
    assert common
    for t in common:
        assert abs(a[t].logprob - b[t].logprob) < 0.1


def test_dtype_auto_follows_the_checkpoint(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    src = checkpoint("llama")
    AutoModelForCausalLM.from_pretrained(str(src)).to(torch.bfloat16).save_pretrained(str(tmp_path))
    _copy_tokenizer(src, tmp_path)
    assert LLM(str(tmp_path)).llm_engine.core.model_info.dtype == torch.bfloat16


def test_mistral_sliding_window_caps_the_context(tmp_path):
    from transformers import AutoModelForCausalLM, MistralConfig

    from tests.checkpoints import DEFAULT_MODEL_DIR

    cfg = MistralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=64,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path))
    _copy_tokenizer(DEFAULT_MODEL_DIR, tmp_path)
    assert LLM(str(tmp_path)).llm_engine.max_model_len == 64
    with pytest.raises(ConfigError, match="sliding window"):
        LLM(str(tmp_path), max_model_len=128)


def test_weights_that_do_not_match_the_config_are_named(checkpoint, tmp_path):
    src = checkpoint("llama")
    shutil.copytree(src, tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    weights = load_file(str(path))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(path))
    with pytest.raises(
        ModelLoadError, match="lacks 1 weight.*model.layers.1.mlp.up_proj.weight'"
    ):  # its checkpoint name
        LLM(str(tmp_path / "m"))

    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, str(path))
    with pytest.raises(ModelLoadError, match="up_proj.weight has shape \\(3, 3\\)"):
        LLM(str(tmp_path / "m"))


def test_all_four_architectures_are_registered(checkpoint):
    for arch, cls in (
        ("llama", "LlamaForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
        ("opt", "OPTForCausalLM"),
    ):
        cfg = json.loads((checkpoint(arch) / "config.json").read_text())
        assert cfg["architectures"] == [cls]
        assert LLM(str(checkpoint(arch))).llm_engine.core.model_info.architecture == cls


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "opt"])
def test_leaving_the_meta_device_makes_what_to_empty_makes(checkpoint, arch):
    """loader._materialize stands in for nn.Module.to_empty (which imports sympy): the same tensors, strides,
    dtypes, devices and Parameter flags."""
    from engine.config import EngineConfig
    from engine.model.loader import _materialize, build_on_meta, inspect_model

    info = inspect_model(EngineConfig(model=str(checkpoint(arch))))
    cpu = torch.device("cpu")
    ours = _materialize(build_on_meta(info, 64, cpu), cpu)
    theirs = build_on_meta(info, 64, cpu).to_empty(device=cpu)

    def described(model: torch.nn.Module) -> list[tuple]:
        tensors = [*model.named_parameters(), *model.named_buffers()]
        return [
            (n, type(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, t.is_leaf) for n, t in tensors
        ]

    assert described(ours) == described(theirs) and described(ours)
