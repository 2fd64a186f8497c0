"""Reading safetensors checkpoints (single file or sharded with an index) into a model.

Loading is strict in both directions: a checkpoint weight with no place in the model, a model
weight the checkpoint lacks, or a shape mismatch is an error naming the weight, because a silently
half-loaded model produces fluent garbage that nobody notices until users do.

Tensors are read lazily: a tensor-parallel rank reads only its slice of each matrix from the file
(safetensors slices), so a 70B checkpoint over 4 ranks never has a full copy in any of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engine.config import ConfigError
from engine.model.layers.linear import CheckpointSlice, MergedLinear


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


class CheckpointTensor:
    """A checkpoint tensor not read yet: its shape, and a read of all of it or of one slice."""

    def __init__(self, shape: tuple[int, ...], source: Any = None) -> None:
        self.shape = shape
        self._source = source  # a safetensors slice, a torch.Tensor, or None (shapes only)

    @classmethod
    def of(cls, tensor: torch.Tensor | CheckpointTensor) -> CheckpointTensor:
        return tensor if isinstance(tensor, CheckpointTensor) else cls(tuple(tensor.shape), tensor)

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
        return self._source[index] if index else self._source[:]


def iter_checkpoint(model_dir: Path, meta: bool = False) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of the checkpoint, unread (see CheckpointTensor); with `meta`, shapes only."""
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    yield name, CheckpointTensor(tuple(sl.get_shape()), None if meta else sl)
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
    expected: set[tuple[str, str | None]] = set()
    for pname in params:
        owner = modules[pname.rsplit(".", 1)[0]]
        if isinstance(owner, MergedLinear) and "" not in owner.parts:
            expected.update((pname, s) for s in owner.shard_offsets)
        else:
            expected.add((pname, None))

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
        param = params.get(name)
        if param is None or (name, shard) not in expected:
            unexpected.append(raw_name)
            continue
        owner_name, leaf = name.rsplit(".", 1)
        owner = modules[owner_name]
        where: CheckpointSlice | None = None
        if hasattr(owner, "checkpoint_slice"):
            where = owner.checkpoint_slice(leaf, shard)
        if where is None:
            _check_shape(raw_name, tensor.shape, tuple(param.shape))
            param.data.copy_(tensor.read())
        else:
            full = list(param.shape)
            full[where.dim] = where.full
            _check_shape(raw_name, tensor.shape, tuple(full))
            target = param.data.narrow(where.dim, where.dest, where.size)
            target.copy_(tensor.read(where.dim, where.start, where.size))
        loaded.add((name, shard))
    if unexpected:
        raise ModelLoadError(
            f"checkpoint has {len(unexpected)} weight(s) this architecture does not use, e.g. {unexpected[:3]}"
        )
    missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} weight(s), e.g. {missing[:3]}")
    finish_loading(model)


def finish_loading(model: nn.Module) -> None:
    """Let layers that hold more than the checkpoint (padding rows) set it, after every weight is in."""
    for m in model.modules():
        finish = getattr(m, "finish_load", None)
        if finish is not None:
            finish()


def _check_shape(name: str, found: tuple[int, ...], wanted: tuple[int, ...]) -> None:
    if found != wanted:
        raise ModelLoadError(
            f"checkpoint weight {name} has shape {found}, the model expects {wanted}: "
            "config.json does not match the weights"
        )
