"""A checkpoint's config.json read the way transformers' config classes read it, without importing transformers.

transformers' import chain is most of a CPU engine's start-up, and the engine reads a few dozen fields of the
config.  For the model types pagekeeper implements (llama, mistral, qwen2, qwen3, opt) this module applies what the
config class would: its defaults for absent fields, its derived fields (num_key_value_heads, head_dim, Qwen's
sliding window, OPT's word_embed_proj_dim), the standard form of the rope parameters (transformers 5's
`rope_parameters`, which 4.x spelt rope_theta + rope_scaling) and its strict field types.

It vouches only for what it can reproduce.  Remote code, another model type, a rope type the engine does not
implement, or a value transformers would refuse or convert (an int where the class wants a float, an unknown dtype
name) make `read_hf_config` return None with the reason, and the loader asks transformers' AutoConfig instead: the
same answer or the same error as before, at the old cost, for that checkpoint only.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from engine.config import ConfigError

log = structlog.get_logger("pagekeeper.loader")

# Field kinds, as transformers 5's strict dataclass validation checks them (exact types: a bool is not an int,
# an int is not a float).
INT, FLOAT, NUM, BOOL, STR = "int", "float", "num", "bool", "str"
UNIT = "float in [0, 1]"  # LlamaConfig's initializer_range (an `interval` validator)
OPT_INT, OPT_NUM, TOKEN_IDS, ROPE, LAYER_TYPES = "int?", "num?", "token_ids", "rope", "layer_types"


@dataclass(frozen=True)
class _Field:
    kind: str
    default: Any


def _fields(**spec: tuple[str, Any]) -> dict[str, _Field]:
    return {name: _Field(kind, default) for name, (kind, default) in spec.items()}


# Each config class's own fields with their defaults (transformers 5.24; 4.x's __init__ defaults are the same
# values).  tests/engine/test_hf_config.py checks this table against the installed classes.
_LLAMA_LIKE = dict(
    hidden_act=(STR, "silu"),
    rms_norm_eps=(FLOAT, 1e-6),
    use_cache=(BOOL, True),
    pad_token_id=(OPT_INT, None),
    tie_word_embeddings=(BOOL, False),
    rope_parameters=(ROPE, None),
)
CLASS_FIELDS: dict[str, dict[str, _Field]] = {
    "llama": _fields(
        vocab_size=(INT, 32000),
        hidden_size=(INT, 4096),
        intermediate_size=(INT, 11008),
        num_hidden_layers=(INT, 32),
        num_attention_heads=(INT, 32),
        num_key_value_heads=(OPT_INT, None),
        max_position_embeddings=(INT, 2048),
        bos_token_id=(OPT_INT, 1),
        eos_token_id=(TOKEN_IDS, 2),
        pretraining_tp=(OPT_INT, 1),
        attention_bias=(BOOL, False),
        attention_dropout=(OPT_NUM, 0.0),
        mlp_bias=(BOOL, False),
        head_dim=(OPT_INT, None),
        initializer_range=(UNIT, 0.02),
        **_LLAMA_LIKE,
    ),
    "mistral": _fields(
        vocab_size=(INT, 32000),
        hidden_size=(INT, 4096),
        intermediate_size=(INT, 14336),
        num_hidden_layers=(INT, 32),
        num_attention_heads=(INT, 32),
        num_key_value_heads=(INT, 8),
        head_dim=(OPT_INT, None),
        max_position_embeddings=(INT, 4096 * 32),
        bos_token_id=(OPT_INT, 1),
        eos_token_id=(TOKEN_IDS, 2),
        sliding_window=(OPT_INT, 4096),
        attention_dropout=(NUM, 0.0),
        initializer_range=(FLOAT, 0.02),
        **_LLAMA_LIKE,
    ),
    "qwen2": _fields(
        vocab_size=(INT, 151936),
        hidden_size=(INT, 4096),
        intermediate_size=(INT, 22016),
        num_hidden_layers=(INT, 32),
        num_attention_heads=(INT, 32),
        num_key_value_heads=(OPT_INT, 32),
        max_position_embeddings=(INT, 32768),
        use_sliding_window=(BOOL, False),
        sliding_window=(OPT_INT, 4096),
        max_window_layers=(INT, 28),
        layer_types=(LAYER_TYPES, None),
        attention_dropout=(NUM, 0.0),
        bos_token_id=(OPT_INT, None),
        eos_token_id=(TOKEN_IDS, None),
        initializer_range=(FLOAT, 0.02),
        **_LLAMA_LIKE,
    ),
    "qwen3": _fields(
        vocab_size=(INT, 151936),
        hidden_size=(INT, 4096),
        intermediate_size=(INT, 22016),
        num_hidden_layers=(INT, 32),
        num_attention_heads=(INT, 32),
        num_key_value_heads=(OPT_INT, 32),
        head_dim=(INT, 128),
        max_position_embeddings=(INT, 32768),
        attention_bias=(BOOL, False),
        use_sliding_window=(BOOL, False),
        sliding_window=(OPT_INT, 4096),
        max_window_layers=(INT, 28),
        layer_types=(LAYER_TYPES, None),
        attention_dropout=(NUM, 0.0),
        bos_token_id=(OPT_INT, None),
        eos_token_id=(TOKEN_IDS, None),
        initializer_range=(FLOAT, 0.02),
        **_LLAMA_LIKE,
    ),
    "opt": _fields(
        vocab_size=(INT, 50272),
        hidden_size=(INT, 768),
        num_hidden_layers=(INT, 12),
        ffn_dim=(INT, 3072),
        max_position_embeddings=(INT, 2048),
        do_layer_norm_before=(BOOL, True),
        _remove_final_layer_norm=(BOOL, False),
        word_embed_proj_dim=(OPT_INT, None),
        dropout=(NUM, 0.1),
        attention_dropout=(NUM, 0.0),
        num_attention_heads=(INT, 12),
        activation_function=(STR, "relu"),
        layerdrop=(NUM, 0.0),
        init_std=(FLOAT, 0.02),
        use_cache=(BOOL, True),
        pad_token_id=(OPT_INT, 1),
        bos_token_id=(OPT_INT, 2),
        eos_token_id=(TOKEN_IDS, 2),
        enable_bias=(BOOL, True),
        layer_norm_elementwise_affine=(BOOL, True),
        tie_word_embeddings=(BOOL, True),
    ),
}

# dtype names whose torch dtype exists in every torch the engine supports (transformers turns the name into
# `getattr(torch, name)`, and fails on any other)
_DTYPE_NAMES = frozenset(("float32", "float16", "bfloat16", "float64", "int8", "uint8", "float8_e4m3fn", "float8_e5m2"))
# Rope types the engine implements, with the keys transformers requires of each (it raises without them).
_ROPE_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_LAYER_TYPES = ("full_attention", "sliding_attention")
# Keys transformers' base class handles specially (renames, pops, validations): left to it when present.
_SPECIAL_KEYS = frozenset(
    (
        "auto_map",
        "attribute_map",
        "per_layer_config",
        "sub_configs",
        "text_config",
        "partial_rotary_factor",
        "output_attentions",
        "attn_implementation",
        "experts_implementation",
        "problem_type",
        "id2label",
        "label2id",
        "num_labels",
    )
)
DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta (and 4.x's rope_theta default)


class HFConfig:
    """The attributes transformers' config would have, for the fields the engine and its tools read."""

    model_type: str  # always there: `resolve` refuses a config without one it knows

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.__dict__)

    def __repr__(self) -> str:
        return f"HFConfig({self.__dict__!r})"


class Unsupported(Exception):
    """The light reader cannot vouch for this config (the message says why); transformers reads it instead."""


def load_hf_config(path: Path, trust_remote_code: bool = False) -> Any:
    """The checkpoint's config: read here when the light reader vouches for it, else by transformers' AutoConfig
    (imported only then); a config transformers cannot read either is a one-line ConfigError."""
    if trust_remote_code:
        config, why = None, "--trust-remote-code: the checkpoint's own code reads it"
    else:
        config, why = read_hf_config(path)
    if config is not None:
        return config
    log.debug("config_read_by_transformers", model=str(path), reason=why)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"--model {path}: config.json could not be read by transformers: {e}") from e


def read_hf_config(path: Path) -> tuple[HFConfig | None, str]:
    """(the config, "") or (None, why transformers must read it).  Errors reading the file itself are left to
    transformers too, so that the message a user sees is the one it gives."""
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return None, f"config.json is not readable JSON ({type(e).__name__})"
    try:
        return HFConfig(resolve(raw)), ""
    except Unsupported as e:
        return None, str(e)


def resolve(raw: Any) -> dict[str, Any]:
    """The config class's attributes for a config.json dict; Unsupported where it cannot vouch for them."""
    if not isinstance(raw, dict):
        raise Unsupported("config.json is not an object")
    model_type = raw.get("model_type")
    if model_type not in CLASS_FIELDS:
        raise Unsupported(f"model_type {model_type!r} is not one the light reader knows")
    special = sorted(k for k in raw if k in _SPECIAL_KEYS)
    if special:
        raise Unsupported(f"config.json sets {special}, which transformers handles specially")
    fields = CLASS_FIELDS[model_type]
    values: dict[str, Any] = {"model_type": model_type}
    for name, spec in fields.items():
        value = raw.get(name, spec.default)
        _check(name, spec.kind, value)
        values[name] = copy.deepcopy(value)
    for key, value in raw.items():  # transformers keeps every other key as an attribute, unchecked
        if key not in fields and key not in ("rope_scaling", "rope_theta", "torch_dtype", "dtype"):
            values[key] = copy.deepcopy(value)
    values["dtype"] = _dtype(raw)
    _derive(model_type, values, raw)
    if model_type == "opt":
        if any(k in raw for k in ("rope_scaling", "rope_theta", "rope_parameters")):
            raise Unsupported("an OPT config with rope fields")
    else:
        values["rope_parameters"] = _rope(raw, values)
        values["rope_scaling"] = values["rope_parameters"]  # transformers 5's alias; 4.x's name
    _validate(model_type, values)
    return values


def _check(name: str, kind: str, value: Any) -> None:
    ok = {
        INT: lambda v: type(v) is int,
        FLOAT: lambda v: type(v) is float,
        UNIT: lambda v: type(v) is float and 0.0 <= v <= 1.0,
        NUM: lambda v: type(v) in (int, float),
        BOOL: lambda v: type(v) is bool,
        STR: lambda v: type(v) is str,
        OPT_INT: lambda v: v is None or type(v) is int,
        OPT_NUM: lambda v: v is None or type(v) in (int, float),
        TOKEN_IDS: lambda v: v is None or type(v) is int or (type(v) is list and all(type(i) is int for i in v)),
        ROPE: lambda v: v is None or type(v) is dict,
        LAYER_TYPES: lambda v: v is None or (type(v) is list and all(t in _LAYER_TYPES for t in v)),
    }[kind]
    if not ok(value):
        raise Unsupported(f"{name} = {value!r:.60} is not the {kind} transformers' class expects")


def _dtype(raw: dict[str, Any]) -> str | None:
    """transformers 5 keeps `dtype` and takes `torch_dtype` (4.x's name) when dtype is absent."""
    found = raw.get("dtype")
    if found is None:
        found = raw.get("torch_dtype")
    if found is not None and (type(found) is not str or found not in _DTYPE_NAMES):
        raise Unsupported(f"dtype {found!r:.40} is not one the light reader knows")
    return found


def _derive(model_type: str, v: dict[str, Any], raw: dict[str, Any]) -> None:
    """The config classes' __post_init__ work."""
    if v["num_attention_heads"] <= 0 or v["hidden_size"] <= 0:
        raise Unsupported("a non-positive hidden_size or num_attention_heads")
    if model_type == "opt":
        if v["word_embed_proj_dim"] is None:
            v["word_embed_proj_dim"] = v["hidden_size"]
        return
    if model_type in ("llama", "mistral") and v["head_dim"] is None:
        v["head_dim"] = v["hidden_size"] // v["num_attention_heads"]
    if v["num_key_value_heads"] is None:
        v["num_key_value_heads"] = v["num_attention_heads"]
    if model_type in ("qwen2", "qwen3"):
        if not v["use_sliding_window"]:
            v["sliding_window"] = None
        if v["layer_types"] is None:
            v["layer_types"] = [
                "sliding_attention"
                if v["sliding_window"] is not None and i >= v["max_window_layers"]
                else "full_attention"
                for i in range(v["num_hidden_layers"])
            ]
    elif "layer_types" in raw:
        raise Unsupported("layer_types on a model type without them")


def _rope(raw: dict[str, Any], v: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's convert_rope_params_to_dict + standardize_rope_params for one (not per-layer) rope."""
    scaling = raw.get("rope_scaling")
    if scaling is not None and type(scaling) is not dict:
        raise Unsupported(f"rope_scaling {scaling!r:.40} is not an object")
    params = copy.deepcopy(scaling or v["rope_parameters"] or {})
    if any(type(x) is dict for x in params.values()):
        raise Unsupported("rope parameters per layer type")
    params.setdefault("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    params.setdefault("rope_type", params.get("type", "default"))
    rope_type = params["rope_type"]
    if rope_type not in _ROPE_REQUIRED:
        raise Unsupported(f"rope type {rope_type!r}")
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", v["max_position_embeddings"])
    missing = [k for k in _ROPE_REQUIRED[rope_type] if k not in params]
    if missing:
        raise Unsupported(f"rope type {rope_type!r} without {missing}")
    for key in _ROPE_NUMBERS:
        if key in params and type(params[key]) not in (int, float):
            raise Unsupported(f"rope {key} = {params[key]!r:.40}")
    return params


def _validate(model_type: str, v: dict[str, Any]) -> None:
    """The class validators that raise (transformers 5 `@strict`)."""
    if model_type == "llama" and v["hidden_size"] % v["num_attention_heads"]:
        raise Unsupported("hidden_size is not a multiple of num_attention_heads")
    layer_types = v.get("layer_types")
    if layer_types is not None and len(layer_types) != v["num_hidden_layers"]:
        raise Unsupported("layer_types does not have num_hidden_layers entries")
