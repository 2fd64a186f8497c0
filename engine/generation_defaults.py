"""Request defaults from a checkpoint's generation_config.json (`--generation-config`), as vLLM applies them.

Model authors ship their recommended sampling there (Qwen's temperature 0.7 / top_p 0.8, Llama's 0.6 / 0.9); a
vLLM user who moves to pagekeeper must get the same answers for requests that leave those fields out.  Only the
sampling keys vLLM reads are taken; `do_sample` and the rest configure transformers' own generate().
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.config import ConfigError, EngineConfig

# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_defaults(config: EngineConfig) -> dict[str, Any]:
    """The SamplingParams defaults the checkpoint asks for ({} with `vllm` or without the file)."""
    choice = config.generation_config
    if choice == "vllm":
        return {}
    if choice == "auto":
        path = Path(config.model_path()) / "generation_config.json"
        if not path.is_file():
            return {}
    else:
        path = Path(choice) / "generation_config.json"
        if not path.is_file():
            raise ConfigError(
                f"--generation-config {choice}: no generation_config.json there (auto reads the model's, vllm none)"
            )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--generation-config: {path} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--generation-config: {path} is not a JSON object")
    defaults = {}
    for key, field_name in SAMPLING_KEYS.items():
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults[field_name] = value
    return defaults
