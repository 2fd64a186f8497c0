"""Turn a local HF checkpoint directory into a ready model, its tokenizer and its limits.

Everything a user can get wrong here (a path that does not exist, no config.json, an architecture
we do not implement, a dtype the checkpoint cannot use) raises ConfigError with a one-line message
that says what to change; the CLI prints it and exits 2.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import structlog
import torch
from torch import nn

from engine.config import ConfigError, EngineConfig
from engine.model.checkpoint_dir import require_checkpoint_dir
from engine.model.device_copy import parallel_copies
from engine.model.hf_config import load_hf_config
from engine.model.interface import CausalLM
from engine.model.quant import QuantSpec, check_device, check_dtype, resolve_quantization
from engine.model.registry import ARCHITECTURES, supported
from engine.model.weights import CheckpointTensor, ModelLoadError, finish_loading, iter_checkpoint
from engine.parallel.group import SINGLE, TPGroup

log = structlog.get_logger("pagekeeper.loader")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelInfo:
    """What the rest of the engine needs to know about a checkpoint before loading its weights."""

    path: Path
    hf_config: Any
    architecture: str
    dtype: torch.dtype
    max_position_embeddings: int
    sliding_window: int | None
    eos_token_ids: list[int]
    quant: QuantSpec | None = None  # weight quantization (engine/model/quant/spec.py); None: none


def inspect_model(config: EngineConfig) -> ModelInfo:
    path = Path(config.model_path())
    require_checkpoint_dir(path)
    hf_config = load_hf_config(path, config.trust_remote_code)
    archs = list(getattr(hf_config, "architectures", None) or [])
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(
            f"--model {path}: architecture {archs or hf_config.model_type!r} is not supported; supported: {supported()}"
        )
    quant = resolve_quantization(config, hf_config, path)
    check_device(config, quant)
    dtype = check_dtype(quant, _resolve_dtype(config.dtype, hf_config), config.dtype)
    return ModelInfo(
        path=path,
        hf_config=hf_config,
        architecture=arch,
        dtype=_DTYPES[dtype],
        max_position_embeddings=int(hf_config.max_position_embeddings),
        sliding_window=_sliding_window(hf_config),
        eos_token_ids=_eos_ids(path, hf_config),
        quant=quant,
    )


def _resolve_dtype(requested: str, hf_config: Any) -> str:
    """The dtype's name: the flag's, or the checkpoint's for auto (float32 when it names none we use)."""
    if requested != "auto":
        return requested
    found = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(found, torch.dtype):
        found = str(found).removeprefix("torch.")
    return str(found) if str(found) in _DTYPES else "float32"


def _sliding_window(hf_config: Any) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    # Qwen2/Qwen3 carry a window that is only used when use_sliding_window is set.
    if hasattr(hf_config, "use_sliding_window") and not hf_config.use_sliding_window:
        return None
    return int(window)


def _eos_ids(path: Path, hf_config: Any) -> list[int]:
    """EOS ids from generation_config.json when present (it may list several), else config.json."""
    ids: Any = None
    gen = path / "generation_config.json"
    if gen.exists():
        import json

        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_on_meta(info: ModelInfo, max_model_len: int, device: torch.device, tp: TPGroup = SINGLE) -> CausalLM:
    cls = ARCHITECTURES[info.architecture]
    try:
        with torch.device("meta"), _default_dtype(info.dtype):
            model = cls(info.hf_config, info.architecture, max_model_len, device, tp=tp)
            if info.quant is not None:
                from engine.model.quant.layers import quantize_linears

                quantize_linears(model, info.quant)
            return model
    except ValueError as e:
        raise ConfigError(f"--model {info.path}: {e}") from e


def check_tensor_parallel(info: ModelInfo, tp_size: int) -> None:
    """ConfigError unless the model's heads and widths split over `tp_size` ranks (every rank's shapes
    are checked on the meta device, so nothing is allocated)."""
    for rank in range(tp_size):
        build_on_meta(info, 1, torch.device("cpu"), TPGroup(rank, tp_size))


def load_model(
    info: ModelInfo, max_model_len: int, device: torch.device, load_format: str = "auto", tp: TPGroup = SINGLE
) -> CausalLM:
    """Build the model without initialising weights (meta device), then fill it from the checkpoint
    (or, with load_format="dummy", with random weights: benchmarks of a shape need no download).
    With tensor parallelism each rank builds and reads only its shard."""
    model = _materialize(build_on_meta(info, max_model_len, device, tp), device)
    fill_weights(model, info, load_format, device)
    return model.eval()


def fill_weights(model: CausalLM, info: ModelInfo, load_format: str, device: torch.device) -> None:
    """Fill a model whose tensors exist (not meta) from the checkpoint, or with random weights for "dummy".
    On a GPU the checkpoint's tensors travel on several threads (engine/model/device_copy.py)."""
    if load_format == "dummy":
        _random_weights(model, info.dtype)
        return
    try:
        with parallel_copies(device):
            model.load_weights(iter_checkpoint(info.path))
    except ModelLoadError as e:
        raise ModelLoadError(_in_model(info, e)) from None


def _materialize(model: CausalLM, device: torch.device) -> CausalLM:
    """`model.to_empty(device=device)` without its `empty_like` of meta tensors, whose stride logic
    (torch._prims_common) imports sympy: about a second of CPU at every engine start, for nothing else."""
    return model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))


def _in_model(info: ModelInfo, e: ModelLoadError) -> str:
    """The error after the flag that chose the checkpoint, so that a config file's reader is pointed at its key
    (engine/server/config_file.py, in_config_terms) even when the message names a file inside the directory."""
    return f"--model {info.path}: {e}"


def check_checkpoint(info: ModelInfo) -> int:
    """Every file readable and every weight present with its shape, without reading the data (for
    `opsctl doctor`); returns the number of tensors, raises ModelLoadError naming what is wrong."""
    model = build_on_meta(
        info, int(getattr(info.hf_config, "max_position_embeddings", 2048) or 2048), torch.device("cpu")
    )
    count = 0

    def counted() -> Iterator[tuple[str, CheckpointTensor]]:
        nonlocal count
        for item in iter_checkpoint(info.path, meta=True):
            count += 1
            yield item

    try:
        model.load_weights(counted())
    except ModelLoadError as e:
        raise ModelLoadError(_in_model(info, e)) from None
    return count


@torch.no_grad()
def _random_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """N(0, 0.02) weights, unit norms, zero biases, each checkpoint tensor drawn from a generator
    seeded by its name: every tensor-parallel rank holds its slice of the same model, so outputs at
    --tensor-parallel-size N can be compared with 1."""
    modules = dict(model.named_modules())
    quantized = set()
    for mname, module in modules.items():
        load_random = getattr(module, "load_random", None)
        if load_random is not None:  # a quantized layer draws and quantizes its own tensors
            offsets = getattr(module, "shard_offsets", None)
            load_random(mname, list(offsets) if offsets is not None and "" not in offsets else [None], dtype)
            quantized.add(mname)
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[0] in quantized:
            continue
        if "norm" in name and name.endswith("weight"):
            p.fill_(1.0)
            continue
        if name.endswith("bias"):
            p.zero_()
            continue
        owner_name, leaf = name.rsplit(".", 1)
        owner = modules[owner_name]
        slice_of = getattr(owner, "checkpoint_slice", None)
        shards = list(getattr(owner, "shard_offsets", {None: None})) if slice_of is not None else [None]
        for shard in shards:
            where = slice_of(leaf, shard or None) if slice_of is not None else None
            full = list(p.shape)
            if where is not None:
                full[where.dim] = where.full
            gen = torch.Generator(device=p.device).manual_seed(zlib.crc32(f"{name}:{shard}".encode()))
            values = torch.empty(full, dtype=p.dtype, device=p.device).normal_(0.0, 0.02, generator=gen)
            if where is None:
                p.copy_(values)
            else:
                p.narrow(where.dim, where.dest, where.size).copy_(values.narrow(where.dim, where.start, where.size))
    finish_loading(model)
