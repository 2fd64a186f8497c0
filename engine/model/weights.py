"""Reading safetensors checkpoints (single file or sharded with an index) into a model.

Loading is strict in both directions: a checkpoint weight with no place in the model, a model
weight the checkpoint lacks, or a shape mismatch is an error naming the weight, because a silently
half-loaded model produces fluent garbage that nobody notices until users do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engine.config import ConfigError
from engine.model.layers.linear import MergedLinear


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


def iter_checkpoint(model_dir: Path, meta: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint; with `meta`, shapes only (headers are read, no data)."""
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if meta:
                        yield name, torch.empty(f.get_slice(name).get_shape(), device="meta")
                    else:
                        yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(
                f"{path}: not a readable safetensors file ({e}); it is corrupt or truncated: "
                "download or convert it again"
            ) from None


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None],
    stacked: dict[str, tuple[str, str]],
) -> None:
    """Copy checkpoint tensors into `model`; `rename` maps or drops names, `stacked` maps fused shards."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    expected: set[tuple[str, str | None]] = set()
    for pname in params:
        owner = modules[pname.rsplit(".", 1)[0]]
        if isinstance(owner, MergedLinear):
            expected.update((pname, s) for s in owner.shard_offsets)
        else:
            expected.add((pname, None))

    loaded: set[tuple[str, str | None]] = set()
    unexpected: list[str] = []
    for raw_name, tensor in weights:
        name = rename(raw_name)
        if name is None:
            continue
        shard = None
        for src, (dst, shard_id) in stacked.items():
            if f".{src}." in name:
                name, shard = name.replace(f".{src}.", f".{dst}."), shard_id
                break
        param = params.get(name)
        if param is None:
            unexpected.append(raw_name)
            continue
        target = param.data
        if shard is not None:
            target = modules[name.rsplit(".", 1)[0]].shard(param, shard)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"checkpoint weight {raw_name} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(target.shape)}: config.json does not match the weights"
            )
        target.copy_(tensor)
        loaded.add((name, shard))
    if unexpected:
        raise ModelLoadError(
            f"checkpoint has {len(unexpected)} weight(s) this architecture does not use, e.g. {unexpected[:3]}"
        )
    missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} weight(s), e.g. {missing[:3]}")
