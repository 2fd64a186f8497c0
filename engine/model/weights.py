"""Reading safetensors checkpoints (single file or sharded with an index) into a model.

Loading is strict in both directions: a checkpoint weight with no place in the model, a model
weight the checkpoint lacks, or a shape mismatch is an error naming the weight, because a silently
half-loaded model produces fluent garbage that nobody notices until users do.

Tensors are read lazily: a tensor-parallel rank reads only its slice of each matrix from the file
(safetensors slices), so a 70B checkpoint over 4 ranks never has a full copy in any of them.

Quantized layers (engine/model/quant/) take part through two optional methods: `expected_leaves()`
(the checkpoint tensors the layer needs, when they differ from its parameters: an FP8 layer
quantized at load needs `weight` only, and computes its `weight_scale`) and
`load_tensor(raw_name, leaf, shard, tensor)` (loads a tensor its own way, e.g. quantizing it, or
accepts an optional one; returns False to leave it to the plain copy).  Dtypes are checked too: an
FP8 or int32 checkpoint tensor is never silently cast into a 16-bit weight.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engine.config import ConfigError
from engine.model.device_copy import current_copier, wait_for_copies
from engine.model.layers.linear import CheckpointSlice


class ModelLoadError(ConfigError):
    """The checkpoint cannot be loaded as it is; the message names the file and what is wrong with it.

    A ConfigError: a person must replace or fix the checkpoint (exit 2, never retried)."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors files in {model_dir}; pagekeeper loads safetensors checkpoints "
            "(convert with transformers' save_pretrained(..., safe_serialization=True))"
        )
    return files


# safetensors' dtype names, for torch tensors handed to the loader directly.
_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


class CheckpointTensor:
    """A checkpoint tensor not read yet: its shape and dtype (safetensors' name, e.g. "BF16", "I32",
    "F8_E4M3"), and a read of all of it or of one slice."""

    def __init__(self, shape: tuple[int, ...], source: Any = None, dtype: str = "") -> None:
        self.shape = shape
        self._source = source  # a safetensors slice, a torch.Tensor, or None (shapes only)
        self.dtype = dtype

    @classmethod
    def of(cls, tensor: torch.Tensor | CheckpointTensor) -> CheckpointTensor:
        if isinstance(tensor, CheckpointTensor):
            return tensor
        return cls(tuple(tensor.shape), tensor, _ST_DTYPES.get(tensor.dtype, str(tensor.dtype)))

    def read(self, dim: int | None = None, start: int = 0, size: int = 0) -> torch.Tensor:
        """The whole tensor, or `size` entries from `start` along `dim`."""
        shape = list(self.shape)
        index: tuple[slice, ...] = ()
        if dim is not None:
            shape[dim] = size
            index = (slice(None),) * dim + (slice(start, start + size),)
        if self._source is None:
            return torch.empty(shape, device="meta")
        if isinstance(self._source, torch.Tensor):
            return self._source[index] if index else self._source
        return self._source[index] if index else self._source[...]


def iter_checkpoint(model_dir: Path, meta: bool = False) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of the checkpoint, unread (see CheckpointTensor); with `meta`, shapes only."""
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    yield name, CheckpointTensor(tuple(sl.get_shape()), None if meta else sl, sl.get_dtype())
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(
                f"{path}: not a readable safetensors file ({e}); it is corrupt or truncated: "
                "download or convert it again"
            ) from None


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]],
    rename: Callable[[str], str | None],
    stacked: dict[str, tuple[str, str]],
) -> None:
    """Copy checkpoint tensors into `model`; `rename` maps or drops names, `stacked` maps fused shards.

    A layer with `checkpoint_slice(leaf, shard)` holds part of its checkpoint tensor (tensor
    parallelism, fused shards): only that part is read, after checking the full tensor's shape."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    expected = expected_tensors(modules)
    loaded: set[tuple[str, str | None]] = set()
    unexpected: list[str] = []
    for raw_name, raw in weights:
        name = rename(raw_name)
        if name is None:
            continue
        tensor = CheckpointTensor.of(raw)
        shard = None
        for src, (dst, shard_id) in stacked.items():
            if f".{src}." in name:
                name, shard = name.replace(f".{src}.", f".{dst}."), shard_id
                break
        owner_name, _, leaf = name.rpartition(".")
        owner = modules.get(owner_name)
        hook = getattr(owner, "load_tensor", None)
        if hook is not None and hook(raw_name, leaf, shard, tensor):
            if (name, shard) in expected:
                loaded.add((name, shard))
            continue
        param = params.get(name)
        if param is None or (name, shard) not in expected:
            unexpected.append(raw_name)
            continue
        slicer = getattr(owner, "checkpoint_slice", None)
        where = slicer(leaf, shard) if slicer is not None else None
        copy_into(param.data, where, tensor, raw_name)
        loaded.add((name, shard))
    if unexpected:
        kv_scales = any(n.endswith((".k_scale", ".v_scale")) for n in unexpected)
        raise ModelLoadError(
            f"checkpoint has {len(unexpected)} weight(s) this architecture does not use, e.g. {unexpected[:3]}"
            + (
                "; checkpoint KV-cache scales are not read (--kv-cache-dtype fp8 calibrates its own)"
                if kv_scales
                else ""
            )
        )
    missing = sorted(_checkpoint_name(n, s, stacked) for n, s in expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} weight(s), e.g. {missing[:3]}")
    finish_loading(model)


def expected_tensors(modules: dict[str, nn.Module]) -> set[tuple[str, str | None]]:
    """(name, shard) of every checkpoint tensor the model needs: each layer's parameters, or the
    leaves it declares (`expected_leaves`), once per fused shard."""
    expected: set[tuple[str, str | None]] = set()
    for mname, module in modules.items():
        declared = getattr(module, "expected_leaves", None)
        leaves = declared() if declared is not None else [n for n, _ in module.named_parameters(recurse=False)]
        offsets = getattr(module, "shard_offsets", None)
        shards: list[str | None] = list(offsets) if offsets is not None and "" not in offsets else [None]
        prefix = f"{mname}." if mname else ""
        expected.update((prefix + leaf, shard) for leaf in leaves for shard in shards)
    return expected


def copy_into(target: torch.Tensor, where: CheckpointSlice | None, tensor: CheckpointTensor, raw_name: str) -> None:
    """Copy a checkpoint tensor (or this rank's slice of it, `where`) into `target`, checking its shape and dtype."""
    check_dtype(raw_name, tensor.dtype, target.dtype)
    copy = current_copier() or _copy_now
    if where is None:
        check_shape(raw_name, tensor.shape, tuple(target.shape))
        copy(target, tensor.read())
        return
    full = list(target.shape)
    full[where.dim] = where.full
    check_shape(raw_name, tensor.shape, tuple(full))
    copy(target.narrow(where.dim, where.dest, where.size), tensor.read(where.dim, where.start, where.size))


def _copy_now(target: torch.Tensor, source: torch.Tensor) -> None:
    target.copy_(source)


def check_dtype(name: str, found: str, wanted: torch.dtype) -> None:
    """A float checkpoint tensor may become any float weight (the engine's --dtype); FP8 and integer
    tensors only what they are (they mean nothing without their scales)."""
    if not found:
        return
    wanted_name = _ST_DTYPES.get(wanted, str(wanted))
    if found == wanted_name or (found in FLOAT_DTYPES and wanted_name in FLOAT_DTYPES):
        return
    if found.startswith("F8"):
        why = "an FP8 tensor: config.json needs its quantization_config (fp8 or compressed-tensors)"
    elif found in ("I32", "I8", "U8", "I64"):
        why = "a packed or integer tensor: config.json's quantization_config must describe it"
    else:
        why = "the wrong type for this weight"
    raise ModelLoadError(f"checkpoint weight {name} is {found}, the model expects {wanted_name} ({why})")


def _checkpoint_name(name: str, shard: str | None, stacked: dict[str, tuple[str, str]]) -> str:
    """A missing (fused name, shard) as the checkpoint spells it (model.layers.0.self_attn.k_proj.qzeros)."""
    if shard is None:
        return name
    for src, (dst, shard_id) in stacked.items():
        if shard_id == shard and f".{dst}." in name:
            return name.replace(f".{dst}.", f".{src}.")
    return f"{name}[{shard}]"


def finish_loading(model: nn.Module) -> None:
    """Let layers that hold more than the checkpoint (padding rows) set it, after every weight is in (and the
    copies a parallel load queued have landed)."""
    wait_for_copies()
    for m in model.modules():
        finish = getattr(m, "finish_load", None)
        if finish is not None:
            finish()


def check_shape(name: str, found: tuple[int, ...], wanted: tuple[int, ...]) -> None:
    if found != wanted:
        raise ModelLoadError(
            f"checkpoint weight {name} has shape {found}, the model expects {wanted}: "
            "config.json does not match the weights"
        )
