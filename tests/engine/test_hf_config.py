"""config.json read without transformers (engine/model/hf_config.py) against transformers' own AutoConfig.

Every architecture the engine implements, with fields present and absent, old and new spellings (torch_dtype,
rope_theta + rope_scaling), and the engine's own view of the result (its shape, rope, window, dtype, EOS ids).
Where the light reader declines a config, the loader's answer is transformers': the same config or the same error.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import ConfigError
from engine.model.hf_config import CLASS_FIELDS, HFConfig, load_hf_config, read_hf_config
from engine.model.layers.rotary import rope_settings
from engine.model.llama import LlamaShape
from engine.model.loader import _eos_ids, _resolve_dtype, _sliding_window
from engine.model.quant.spec import _config_dict

ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "opt": "OPTForCausalLM",
}
# What the engine and its tools read from a config (engine/model/, engine/runner/, engine/loop/llm_engine.py, loader.py)
ENGINE_FIELDS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "attention_bias",
    "mlp_bias", "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings",
    "sliding_window", "use_sliding_window", "eos_token_id", "bos_token_id", "pad_token_id", "quantization_config",
    "ffn_dim", "word_embed_proj_dim", "do_layer_norm_before", "_remove_final_layer_norm", "enable_bias",
    "layer_norm_elementwise_affine", "activation_function",
)  # fmt: skip
_ABSENT = object()

# Real checkpoints' config.json shapes (trimmed), and the spellings that differ between transformers 4 and 5
CONFIGS: list[dict[str, Any]] = [
    {"model_type": "llama"},
    {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-05,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False,
        "mlp_bias": False, "attention_bias": False, "pretraining_tp": 1, "transformers_version": "4.43.0.dev0",
    },
    {"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1000000.0},
    {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0}, "max_position_embeddings": 4096},
    {"model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}, "dtype": "float16"},
    {"model_type": "llama", "rope_theta": 5.0, "rope_parameters": {"rope_type": "default"}},
    {"model_type": "llama", "dtype": "bfloat16", "torch_dtype": "float16", "head_dim": 64, "hidden_size": 1024,
     "num_attention_heads": 8, "num_key_value_heads": None, "attention_bias": True},
    {"model_type": "llama", "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                     "zero_point": True, "version": "gemm"}},
    {"model_type": "llama", "sliding_window": 128, "pad_token_id": -1, "eos_token_id": None, "custom_key": [1, "a"]},
    {"model_type": "mistral"},
    {"model_type": "mistral", "sliding_window": None, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
     "max_position_embeddings": 32768, "num_key_value_heads": 8, "head_dim": 128},
    {"model_type": "mistral", "sliding_window": 4096, "hidden_size": 512, "num_attention_heads": 8},
    {"model_type": "qwen2"},
    {
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
        "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064, "rms_norm_eps": 1e-06,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": 131072,
        "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645, "attention_dropout": 0.0,
    },
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 256, "max_window_layers": 2,
     "num_hidden_layers": 4},
    {"model_type": "qwen2", "layer_types": ["full_attention"] * 3, "num_hidden_layers": 3, "head_dim": 64},
    {"model_type": "qwen3"},
    {"model_type": "qwen3", "head_dim": 128, "hidden_size": 2560, "num_attention_heads": 32,
     "num_key_value_heads": 8, "rope_theta": 1000000, "tie_word_embeddings": True, "attention_bias": False,
     "sliding_window": None, "use_sliding_window": False, "torch_dtype": "bfloat16"},
    {"model_type": "opt"},
    {"model_type": "opt", "hidden_size": 1024, "word_embed_proj_dim": 512, "do_layer_norm_before": False,
     "_remove_final_layer_norm": False, "ffn_dim": 4096, "num_attention_heads": 16, "torch_dtype": "float16",
     "activation_function": "relu", "enable_bias": True, "prefix": "</s>", "pad_token_id": 1},
    {"model_type": "opt", "layer_norm_elementwise_affine": False, "enable_bias": False, "dropout": 0.0},
]  # fmt: skip


def _with_arch(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"architectures": [ARCH[cfg["model_type"]]], **cfg}


def _write(tmp_path: Path, cfg: dict[str, Any], name: str = "m") -> Path:
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _normalized(value: Any) -> Any:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def _engine_view(cfg: Any, path: Path) -> dict[str, Any]:
    """The engine's own reading of a config: what a difference in it would change."""
    view = {name: _normalized(getattr(cfg, name, _ABSENT)) for name in ENGINE_FIELDS}
    view["dtype"] = _resolve_dtype("auto", cfg)
    view["window"] = _sliding_window(cfg)
    view["eos_ids"] = _eos_ids(path, cfg)
    view["quantization"] = _config_dict(cfg)
    if cfg.model_type != "opt":
        view["shape"] = dataclasses.asdict(LlamaShape.from_hf(cfg, ARCH[cfg.model_type]))
        view["rope"] = rope_settings(cfg)
    return view


@pytest.mark.parametrize("cfg", [_with_arch(c) for c in CONFIGS], ids=lambda c: json.dumps(c)[:60])
def test_the_light_config_is_what_transformers_reads(tmp_path, cfg):
    from transformers import AutoConfig

    path = _write(tmp_path, cfg)
    light, why = read_hf_config(path)
    assert isinstance(light, HFConfig), why
    theirs = AutoConfig.from_pretrained(str(path))
    mine, expected = _engine_view(light, path), _engine_view(theirs, path)
    assert mine == expected
    assert type(load_hf_config(path)) is HFConfig


@pytest.mark.parametrize("model_type", sorted(CLASS_FIELDS))
def test_the_defaults_are_the_config_classes(tmp_path, model_type):
    """Every field of transformers' class is in the table, and an empty config reads as the class's defaults."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    own = set(cls.__dict__.get("__annotations__", {})) & {f.name for f in dataclasses.fields(cls)}
    assert own <= set(CLASS_FIELDS[model_type]), own - set(CLASS_FIELDS[model_type])
    path = _write(tmp_path, {"model_type": model_type})
    light, _ = read_hf_config(path)
    theirs = AutoConfig.from_pretrained(str(path))
    for name in CLASS_FIELDS[model_type]:
        assert getattr(light, name) == getattr(theirs, name), name


# Values transformers refuses or converts (strict types), and features the reader does not reproduce
DECLINED: list[tuple[dict[str, Any], str]] = [
    ({"model_type": "llama", "rms_norm_eps": 1}, "float"),
    ({"model_type": "llama", "vocab_size": True}, "int"),
    ({"model_type": "llama", "vocab_size": 12.0}, "int"),
    ({"model_type": "llama", "tie_word_embeddings": 1}, "bool"),
    ({"model_type": "llama", "eos_token_id": [1, "a"]}, "token_ids"),
    ({"model_type": "llama", "hidden_size": 100, "num_attention_heads": 3}, "multiple"),
    ({"model_type": "llama", "num_attention_heads": 0}, "non-positive"),
    ({"model_type": "llama", "dtype": "bf16"}, "dtype"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "linear"}}, "without"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "without"),
    ({"model_type": "llama", "rope_theta": "big"}, "rope_theta"),
    ({"model_type": "llama", "auto_map": {"AutoConfig": "x.Y"}}, "specially"),
    ({"model_type": "qwen2", "layer_types": ["global"] * 32}, "layer_types"),
    ({"model_type": "qwen2", "layer_types": ["full_attention"]}, "num_hidden_layers"),
    ({"model_type": "qwen3", "head_dim": None}, "int"),
    ({"model_type": "opt", "rope_theta": 10000.0}, "OPT"),
    ({"model_type": "gemma"}, "model_type"),
    ({"hidden_size": 64}, "model_type"),
]


@pytest.mark.parametrize("cfg,why", DECLINED, ids=lambda c: json.dumps(c)[:50] if isinstance(c, dict) else "")
def test_what_the_reader_cannot_vouch_for_goes_to_transformers(tmp_path, cfg, why):
    from transformers import AutoConfig

    path = _write(tmp_path, _with_arch(cfg) if cfg.get("model_type") in ARCH else cfg)
    light, reason = read_hf_config(path)
    assert light is None and why in reason, reason
    try:
        expected: Any = AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as e:
        with pytest.raises(ConfigError, match="could not be read by transformers"):
            load_hf_config(path)
        print(f"{cfg}: transformers refuses it ({type(e).__name__}), and so does the loader")
        return
    except Exception as e:  # noqa: BLE001 - transformers fails outside the errors the loader turns into a line
        with pytest.raises(type(e)):
            load_hf_config(path)
        return
    got = load_hf_config(path)
    assert type(got) is type(expected) and got.to_dict() == expected.to_dict()


def test_trust_remote_code_always_goes_to_transformers(tmp_path, monkeypatch):
    path = _write(tmp_path, _with_arch({"model_type": "llama"}))
    calls = []
    import transformers

    real = transformers.AutoConfig.from_pretrained
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: calls.append(k) or real(*a, **k))
    assert type(load_hf_config(path, trust_remote_code=True)) is not HFConfig
    assert calls == [{"trust_remote_code": True}]
    assert type(load_hf_config(path)) is HFConfig and len(calls) == 1


def test_a_declined_config_is_logged_at_debug(tmp_path):
    from tests.debug_logs import debug_logs

    path = _write(tmp_path, _with_arch({"model_type": "llama", "rope_scaling": {"rope_type": "linear"}}))
    with debug_logs() as logs, pytest.raises(ConfigError, match="Missing required keys"):
        load_hf_config(path)
    [line] = [entry for entry in logs if entry["event"] == "config_read_by_transformers"]
    assert line["log_level"] == "debug" and "without ['factor']" in line["reason"]


KINDS_OF_WRONG = [None, True, 1, 1.5, -1, 0, "x", [1], {"a": 1}]


@pytest.mark.parametrize("model_type", sorted(CLASS_FIELDS))
def test_every_field_with_every_kind_of_value_is_read_as_transformers_reads_it_or_declined(tmp_path, model_type):
    """A field set to a value of each JSON type: the light reader either agrees with transformers (on what the
    engine reads) or declines, never accepts a config transformers refuses."""
    from transformers import AutoConfig

    agreed = declined = 0
    for name in CLASS_FIELDS[model_type]:
        for value in KINDS_OF_WRONG:
            cfg = _with_arch({"model_type": model_type, name: value})
            path = _write(tmp_path, cfg, f"{name}-{len(str(value))}-{type(value).__name__}")
            light, _ = read_hf_config(path)
            try:
                theirs = AutoConfig.from_pretrained(str(path))
            except Exception:  # noqa: BLE001 - any refusal
                assert light is None, f"{name}={value!r}: transformers refuses it, the light reader accepted it"
                declined += 1
                continue
            if light is None:
                declined += 1
                continue
            try:
                expected = _engine_view(theirs, path)
            except (ValueError, TypeError, ZeroDivisionError) as e:  # the engine itself refuses it: so must mine
                with pytest.raises(type(e)):
                    _engine_view(light, path)
                continue
            assert _engine_view(light, path) == expected, f"{name}={value!r}"
            agreed += 1
    print(f"{model_type}: {agreed} values read alike, {declined} declined")
    assert agreed > 0
