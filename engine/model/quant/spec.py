"""What quantization a model loads with: the checkpoint's `quantization_config` reconciled with
`--quantization`, checked once before anything is built.

Three formats are read (each refused with one line when a field says something we do not do):

- AutoAWQ GEMM (`quant_method: awq`, `version: gemm`, 4 bits, zero points, any group size that
  divides the layers): int4 weights packed eight to an int32 in AWQ's order, per-group fp16 scales
  and packed zero points (engine/model/quant/awq.py has the layout).
- FP8 weights: a 16-bit checkpoint quantized at load (`--quantization fp8`), vLLM's serialized
  `quant_method: fp8` (per-tensor weight scales), or compressed-tensors' `float-quantized` format
  (per-channel or per-tensor weight scales).  Activations are always quantized per token at run
  time: a checkpoint's static `input_scale` is read and checked but dynamic scales replace it
  (they are never coarser), which the start-up log says.

Refused: a method we do not implement (GPTQ, bitsandbytes, ...), `--quantization X` that
contradicts the checkpoint, AWQ in bfloat16 (its scales are float16), and FP8 (weights or KV cache)
on a GPU without FP8 support (compute capability < 8.9).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ConfigError, EngineConfig

# config.json names of layers we never quantize (a modules_to_not_convert / ignore list naming only
# these asks for nothing we would do anyway).
NEVER_QUANTIZED = ("lm_head", "embed_tokens", "embed_positions", "project_in", "project_out")
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class QuantSpec:
    """How the model's linear layers are stored (plain data: it travels to tensor-parallel workers)."""

    method: str  # "awq" or "fp8"
    source: str  # "checkpoint" (pre-quantized) or "load" (fp8 quantized while loading a 16-bit checkpoint)
    group_size: int = 0  # awq
    fmt: str = ""  # where the config came from: "awq", "fp8", "compressed-tensors", "--quantization fp8"
    static_input_scales: bool = False  # fp8 checkpoints with static activation scales (replaced by dynamic)

    @property
    def prequantized(self) -> bool:
        return self.source == "checkpoint"

    def describe(self) -> str:
        if self.method == "awq":
            return f"awq int4 (group {self.group_size}, zero points), from the checkpoint"
        what = "fp8 e4m3 weights (per-channel scales), activations per token"
        if self.static_input_scales:
            what += " (the checkpoint's static input scales are not used)"
        return what + (" (quantized at load)" if self.source == "load" else f" ({self.fmt} checkpoint)")


def _config_dict(hf_config: Any) -> dict[str, Any] | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if hasattr(qc, "to_dict"):
        qc = qc.to_dict()
    if not isinstance(qc, dict):
        raise ConfigError(f"config.json's quantization_config is not an object: {qc!r}")
    return qc


def resolve_quantization(config: EngineConfig, hf_config: Any, path: Path) -> QuantSpec | None:
    """The QuantSpec for this checkpoint and these flags (None: unquantized), or a one-line ConfigError."""
    qc = _config_dict(hf_config)
    flag = config.quantization
    if qc is None:
        if flag == "awq":
            raise ConfigError(
                f"--quantization awq: {path}/config.json has no quantization_config, so it is not an AWQ checkpoint; "
                "make one with `python -m engine.model.quantize awq SRC DST`, or leave --quantization out"
            )
        if flag == "fp8":
            return QuantSpec("fp8", "load", fmt="--quantization fp8")
        return None
    method = str(qc.get("quant_method", "")).lower()
    where = f"{path}/config.json quantization_config"
    if method == "awq":
        spec = _awq(qc, where)
    elif method == "fp8":
        spec = _fp8(qc, where)
    elif method == "compressed-tensors":
        spec = _compressed_tensors(qc, where)
    else:
        raise ConfigError(
            f"{where}: quant_method {method!r} is not supported; pagekeeper loads awq (AutoAWQ GEMM), fp8 and "
            "compressed-tensors FP8 checkpoints, or 16-bit checkpoints with --quantization fp8"
        )
    if flag is not None and flag != spec.method:
        raise ConfigError(
            f"--quantization {flag}: {path} is already quantized ({method}, loaded as {spec.method}); "
            f"use --quantization {spec.method} or leave the flag out"
        )
    return spec


def _awq(qc: dict[str, Any], where: str) -> QuantSpec:
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise ConfigError(f"{where}: AWQ with bits={bits} is not supported (only 4-bit)")
    if version != "gemm":
        raise ConfigError(
            f"{where}: AWQ version {version!r} is not supported; pagekeeper reads AutoAWQ's GEMM layout "
            '(version "gemm"); re-export the model with version="GEMM"'
        )
    if qc.get("zero_point", True) is not True:
        raise ConfigError(f"{where}: AWQ without zero points (zero_point=false) is not supported")
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
        raise ConfigError(
            f"{where}: AWQ group_size {group!r} is not supported (a positive group size; -1, one group per row, is not)"
        )
    _check_not_converted(qc.get("modules_to_not_convert"), where, "modules_to_not_convert")
    return QuantSpec("awq", "checkpoint", group_size=group, fmt="awq")


def _fp8(qc: dict[str, Any], where: str) -> QuantSpec:
    if qc.get("weight_block_size") is not None:
        raise ConfigError(
            f"{where}: block-wise FP8 (weight_block_size {qc['weight_block_size']}) is not supported; "
            "pagekeeper reads per-tensor or per-channel FP8 weight scales"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ConfigError(f"{where}: activation_scheme {scheme!r} is not supported (dynamic or static)")
    _check_not_converted(qc.get("ignored_layers") or qc.get("modules_to_not_convert"), where, "ignored_layers")
    return QuantSpec("fp8", "checkpoint", fmt="fp8", static_input_scales=scheme == "static")


def _compressed_tensors(qc: dict[str, Any], where: str) -> QuantSpec:
    fmt = qc.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ConfigError(f"{where}: compressed-tensors format {fmt!r} is not supported (only float-quantized FP8)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"{where}: {len(groups)} config_groups; pagekeeper reads exactly one (FP8 for every Linear)")
    group = next(iter(groups.values()))
    weights = group.get("weights") or {}
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        raise ConfigError(
            f"{where}: weights of {weights.get('num_bits')}-bit type {weights.get('type')!r} are not supported "
            "(only 8-bit float, FP8 e4m3)"
        )
    if weights.get("strategy") not in ("channel", "tensor"):
        raise ConfigError(
            f"{where}: FP8 weight strategy {weights.get('strategy')!r} is not supported (channel or tensor)"
        )
    if weights.get("dynamic"):
        raise ConfigError(f"{where}: dynamic FP8 weight scales are not supported (the checkpoint must hold them)")
    acts = group.get("input_activations")
    static = False
    if acts is not None:
        if (acts.get("num_bits"), acts.get("type")) != (8, "float"):
            raise ConfigError(f"{where}: input activations of {acts.get('num_bits')}-bit {acts.get('type')!r}")
        static = not acts.get("dynamic", False)
    targets = group.get("targets") or ["Linear"]
    if targets != ["Linear"]:
        raise ConfigError(f'{where}: targets {targets} are not supported (only ["Linear"])')
    _check_not_converted(qc.get("ignore"), where, "ignore")
    if qc.get("kv_cache_scheme") is not None:
        raise ConfigError(
            f"{where}: kv_cache_scheme (checkpoint KV scales) is not supported; pagekeeper calibrates its FP8 KV "
            "scales at start-up (--kv-cache-dtype fp8): remove kv_cache_scheme and the k_scale/v_scale tensors"
        )
    return QuantSpec("fp8", "checkpoint", fmt="compressed-tensors", static_input_scales=static)


def _check_not_converted(names: Any, where: str, key: str) -> None:
    """A list of layers left unquantized is honoured only when it names layers we never quantize."""
    for name in names or []:
        leaf = str(name).rsplit(".", 1)[-1].removeprefix("re:")
        if leaf not in NEVER_QUANTIZED:
            raise ConfigError(
                f"{where}: {key} lists {name!r}; pagekeeper quantizes every decoder linear layer and keeps only "
                f"{', '.join(NEVER_QUANTIZED)} unquantized"
            )


def check_dtype(spec: QuantSpec | None, dtype_name: str, requested: str) -> str:
    """The activation dtype a quantized model runs in: AWQ's scales are float16, so auto means float16
    and bfloat16 is refused; anything else is unchanged."""
    if spec is None or spec.method != "awq":
        return dtype_name
    if requested == "auto":
        return "float16" if dtype_name != "float32" else dtype_name
    if dtype_name == "bfloat16":
        raise ConfigError(
            "--dtype bfloat16 with an AWQ checkpoint: AWQ's scales and kernels are float16; use --dtype half "
            "(or auto, or float32)"
        )
    return dtype_name


def check_device(config: EngineConfig, spec: QuantSpec | None) -> None:
    """FP8 weights and the FP8 KV cache need FP8 hardware on a GPU (compute capability 8.9+: Ada, Hopper)."""
    device = config.resolved_device()
    fp8_weights = spec is not None and spec.method == "fp8"
    if not device.startswith("cuda") or not (fp8_weights or config.kv_cache_fp8):
        return
    import torch

    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        flag = "--quantization fp8" if fp8_weights else f"--kv-cache-dtype {config.kv_cache_dtype}"
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"{flag} needs a GPU with FP8 support (compute capability 8.9+: L4, L40S, H100, H200); {device} is "
            f"{name} ({capability[0]}.{capability[1]}): leave {flag.split()[0]} out"
            + (" or use --quantization awq" if fp8_weights else "")
        )
