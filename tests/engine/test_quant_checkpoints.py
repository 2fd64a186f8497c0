"""Every malformed AWQ / FP8 checkpoint, and every contradictory flag, is one line that names what is wrong
(a ConfigError: the server prints it and exits 2, never retried)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.config import ConfigError
from engine.default_model import DEFAULT_MODEL_DIR
from engine.model.quantize import write_awq, write_fp8
from tests.server.harness import REPO, free_port

Mutation = Callable[[dict[str, Any], dict[str, torch.Tensor]], None]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant-src")
    return {
        "awq": write_awq(DEFAULT_MODEL_DIR, root / "awq", 128),
        "fp8": write_fp8(DEFAULT_MODEL_DIR, root / "fp8", "compressed-tensors"),
        "plain": DEFAULT_MODEL_DIR,
    }


def _qc(**changes: Any) -> Mutation:
    def mutate(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        cfg["quantization_config"].update(changes)

    return mutate


def _drop(name: str) -> Mutation:
    def mutate(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]

    return mutate


def _set(name: str, value: torch.Tensor) -> Mutation:
    return lambda cfg, tensors: tensors.__setitem__(name, value)


def _retype(name: str, dtype: torch.dtype) -> Mutation:
    return lambda cfg, tensors: tensors.__setitem__(name, tensors[name].to(dtype))


def _ct_weights(**changes: Any) -> Mutation:
    def mutate(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(changes)

    return mutate


def _no_quant_config(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    del cfg["quantization_config"]


def _method(name: str) -> Mutation:
    return lambda cfg, tensors: cfg.__setitem__("quantization_config", {"quant_method": name, "bits": 4})


L0 = "model.layers.0"
L1 = "model.layers.1"
# (case, source, mutation, engine flags, words the one line must contain)
CASES: list[tuple[str, str, Mutation | None, dict[str, Any], list[str]]] = [
    (
        "awq missing qzeros",
        "awq",
        _drop(f"{L1}.self_attn.k_proj.qzeros"),
        {},
        [f"{L1}.self_attn.k_proj.qzeros", "lacks"],
    ),
    (
        "awq scales for another group size",
        "awq",
        _set(f"{L0}.mlp.down_proj.scales", torch.ones(6, 128, dtype=torch.float16)),
        {},
        [f"{L0}.mlp.down_proj.scales", "(6, 128)", "group size 128 expects (3, 128)"],
    ),
    (
        "awq qweight stored as float",
        "awq",
        _retype(f"{L0}.self_attn.q_proj.qweight", torch.float16),
        {},
        [f"{L0}.self_attn.q_proj.qweight", "F16", "int32"],
    ),
    ("awq 8 bits", "awq", _qc(bits=8), {}, ["bits=8"]),
    ("awq gemv layout", "awq", _qc(version="gemv"), {}, ["version 'gemv'", "GEMM"]),
    ("awq without zero points", "awq", _qc(zero_point=False), {}, ["zero_point=false"]),
    ("awq group size that does not divide", "awq", _qc(group_size=96), {}, ["group size 96", "128 input features"]),
    (
        "awq with a leftover float weight",
        "awq",
        _set(f"{L0}.self_attn.q_proj.weight", torch.zeros(128, 128, dtype=torch.float16)),
        {},
        [f"{L0}.self_attn.q_proj.weight", "does not use"],
    ),
    (
        "awq leaving a decoder layer unconverted",
        "awq",
        _qc(modules_to_not_convert=["model.layers.0.mlp.down_proj"]),
        {},
        ["modules_to_not_convert", "down_proj"],
    ),
    ("--quantization fp8 on an awq checkpoint", "awq", None, {"quantization": "fp8"}, ["already quantized", "awq"]),
    ("awq in bfloat16", "awq", None, {"dtype": "bfloat16"}, ["--dtype bfloat16", "float16"]),
    ("gptq", "awq", _method("gptq"), {}, ["quant_method 'gptq' is not supported"]),
    ("--quantization awq on a plain checkpoint", "plain", None, {"quantization": "awq"}, ["no quantization_config"]),
    (
        "fp8 missing weight_scale",
        "fp8",
        _drop(f"{L1}.mlp.up_proj.weight_scale"),
        {},
        [f"{L1}.mlp.up_proj.weight_scale"],
    ),
    (
        "fp8 weight stored in bfloat16",
        "fp8",
        _retype(f"{L0}.self_attn.o_proj.weight", torch.bfloat16),
        {},
        [f"{L0}.self_attn.o_proj.weight", "BF16", "float8_e4m3fn"],
    ),
    (
        "fp8 weight_scale of the wrong shape",
        "fp8",
        _set(f"{L0}.self_attn.v_proj.weight_scale", torch.ones(7)),
        {},
        [f"{L0}.self_attn.v_proj.weight_scale", "(7,)", "per output channel"],
    ),
    ("fp8 block-wise scales", "fp8", _qc(quant_method="fp8", weight_block_size=[128, 128]), {}, ["block-wise"]),
    ("compressed-tensors int8", "fp8", _ct_weights(type="int"), {}, ["8-bit type 'int'", "FP8"]),
    ("compressed-tensors group strategy", "fp8", _ct_weights(strategy="group"), {}, ["strategy 'group'"]),
    ("compressed-tensors kv cache scales", "fp8", _qc(kv_cache_scheme={"num_bits": 8}), {}, ["kv_cache_scheme"]),
    ("fp8 weights without a quantization_config", "fp8", _no_quant_config, {}, ["F8_E4M3", "quantization_config"]),
]


def _broken(src: Path, dst: Path, mutation: Mutation | None) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    if mutation is not None:
        cfg = json.loads((dst / "config.json").read_text())
        tensors = load_file(str(dst / "model.safetensors"))
        mutation(cfg, tensors)
        (dst / "config.json").write_text(json.dumps(cfg))
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("case,source,mutation,flags,words", CASES, ids=[c[0] for c in CASES])
def test_malformed_quantized_checkpoints_are_one_line_naming_the_problem(
    sources, tmp_path, case, source, mutation, flags, words
):
    path = _broken(sources[source], tmp_path / "m", mutation)
    with pytest.raises(ConfigError) as e:
        LLM(str(path), **flags)
    line = str(e.value)
    print(f"{case}: {line}")
    assert "\n" not in line
    for w in words:
        assert w in line, f"{w!r} not in {line!r}"


def test_flags_outside_the_choices_are_refused_in_one_line():
    for kwargs, words in (
        ({"quantization": "gptq"}, "--quantization must be one of fp8, awq"),
        ({"kv_cache_dtype": "int8"}, "--kv-cache-dtype must be one of auto, fp8, fp8_e4m3"),
    ):
        with pytest.raises(ConfigError) as e:
            LLM(None, **kwargs)
        assert "\n" not in str(e.value) and words in str(e.value), str(e.value)


@pytest.mark.slow
def test_the_server_exits_2_with_one_line(sources, tmp_path):
    path = _broken(sources["awq"], tmp_path / "m", _drop(f"{L1}.self_attn.k_proj.qzeros"))
    r = subprocess.run(
        [sys.executable, "-m", "engine.server", "--model", str(path), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    print(f"server: exit {r.returncode}: {lines}")
    assert r.returncode == 2 and len(lines) == 1 and f"{L1}.self_attn.k_proj.qzeros" in lines[0]
