"""Quantized column- and row-parallel linear layers, and the swap that puts them in a built model.

The architectures are written once, with MergedLinear / ColumnLinear / RowLinear
(engine/model/layers/linear.py).  A quantized model is built the same way on the meta device, then
every such layer is replaced by a QuantMergedLinear / QuantRowLinear with the same split: the
tensor-parallel geometry (which rows or columns of the checkpoint matrix this rank holds, where
each fused shard lands) is the unquantized layer's, and a `LinearScheme` (FP8 or AWQ) says how
the weight is stored, how each checkpoint tensor maps onto that geometry, and how to multiply.
Embeddings and the LM head stay unquantized (as AutoAWQ and vLLM keep them).
"""

from __future__ import annotations

import zlib
from typing import Protocol

import torch
from torch import nn

from engine.model.layers.linear import CheckpointSlice, ColumnLinear, MergedLinear, RowLinear
from engine.model.quant.spec import QuantSpec
from engine.model.weights import CheckpointTensor, copy_into
from engine.parallel.group import SINGLE, Part, TPGroup


class LinearScheme(Protocol):
    """How one quantization method stores, loads and applies a linear layer's weight."""

    def create(self, layer: _QuantLinear, in_features: int, out_features: int, bias: bool) -> None:
        """Register the layer's parameters (on the current default device and dtype)."""

    def leaves(self, bias: bool) -> list[str]:
        """The checkpoint tensors each layer (each fused shard) needs."""

    def column_slice(self, leaf: str, part: Part, dest: int) -> CheckpointSlice:
        """Where output columns [part.start, +part.size) of `leaf` sit, in the checkpoint and in the layer."""

    def row_slice(self, leaf: str, part: Part) -> CheckpointSlice | None:
        """Where input rows [part.start, +part.size) of `leaf` sit (None: the leaf is replicated)."""

    def check_column(self, parts: dict[str, Part], offsets: dict[str, tuple[int, int]]) -> None:
        """ValueError (naming what to change) when this split cannot be stored."""

    def check_row(self, part: Part, tp: TPGroup) -> None:
        """ValueError (naming the tensor-parallel sizes that work) when this split cannot be stored."""

    def load(
        self, layer: _QuantLinear, raw_name: str, leaf: str, where: CheckpointSlice | None, tensor: CheckpointTensor
    ) -> bool:
        """Load `leaf` its own way (True), or leave it to the plain copy (False)."""

    def from_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The checkpoint tensors (by leaf) of a 16/32-bit weight ``[out, in]`` (load_format=dummy)."""

    def apply(self, layer: _QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` without the bias."""

    def finish(self, layer: _QuantLinear) -> None:
        """Checks once every tensor is in (e.g. the GPU kernel's shape constraints)."""


class _QuantLinear(nn.Module):
    """What both splits share: the scheme's parameters, loading through it, the bias added last."""

    scheme: LinearScheme
    bias: nn.Parameter | None

    def _setup(self, scheme: LinearScheme, in_features: int, out_features: int, bias: bool) -> None:
        self.scheme = scheme
        self.in_features, self.out_features = in_features, out_features
        scheme.create(self, in_features, out_features, bias)

    def expected_leaves(self) -> list[str]:
        return self.scheme.leaves(self.bias is not None)

    def checkpoint_slice(self, leaf: str, shard_id: str | None) -> CheckpointSlice | None:
        raise NotImplementedError

    def load_tensor(self, raw_name: str, leaf: str, shard: str | None, tensor: CheckpointTensor) -> bool:
        return self.scheme.load(self, raw_name, leaf, self.checkpoint_slice(leaf, shard), tensor)

    def full_weight_shape(self, shard: str | None) -> tuple[int, int]:
        """The unquantized checkpoint weight ``[out, in]`` this layer (shard) is a slice of."""
        raise NotImplementedError

    @torch.no_grad()
    def load_random(self, name: str, shards: list[str | None], dtype: torch.dtype) -> None:
        """Random weights (load_format=dummy): exactly the N(0, 0.02) 16-bit weights the unquantized model
        draws (same generator, seed and device: engine/model/loader.py), quantized as a checkpoint
        would be and sliced as this rank's share, so a quantized dummy model is the quantized version
        of the unquantized one (the benchmark's logit errors compare them)."""
        device = next(p.device for p in self.parameters())
        for shard in shards:
            gen = torch.Generator(device=device).manual_seed(zlib.crc32(f"{name}.weight:{shard}".encode()))
            shape = self.full_weight_shape(shard)
            weight = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
            tensors = self.scheme.from_weight(weight)
            if self.bias is not None:
                tensors["bias"] = torch.zeros(shape[0], dtype=dtype, device=device)
            for leaf, value in tensors.items():
                raw, where, tensor = f"{name}.{leaf}", self.checkpoint_slice(leaf, shard), CheckpointTensor.of(value)
                if not self.scheme.load(self, raw, leaf, where, tensor):
                    copy_into(getattr(self, leaf).data, where, tensor, raw)

    def finish_load(self) -> None:
        self.scheme.finish(self)

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={type(self.scheme).__name__}"


class QuantMergedLinear(_QuantLinear):
    """MergedLinear (column-parallel over named parts) with a quantized weight."""

    def __init__(self, in_features: int, parts: dict[str, Part], bias: bool, scheme: LinearScheme) -> None:
        super().__init__()
        self.parts = parts
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, part in parts.items():
            self.shard_offsets[name] = (start, part.size)
            start += part.size
        scheme.check_column(parts, self.shard_offsets)
        self._setup(scheme, in_features, start, bias)

    def checkpoint_slice(self, leaf: str, shard_id: str | None) -> CheckpointSlice:
        key = shard_id or ""
        return self.scheme.column_slice(leaf, self.parts[key], self.shard_offsets[key][0])

    def full_weight_shape(self, shard: str | None) -> tuple[int, int]:
        return (self.parts[shard or ""].full, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_bias(self.scheme.apply(self, x))


class QuantRowLinear(_QuantLinear):
    """RowLinear (input dimension split over the ranks, partial outputs summed) with a quantized weight."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, scheme: LinearScheme, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.part = Part.even(in_features, tp, "input features of a row-parallel layer")
        self.tp = tp
        scheme.check_row(self.part, tp)
        self._setup(scheme, self.part.size, out_features, bias)

    def checkpoint_slice(self, leaf: str, shard_id: str | None) -> CheckpointSlice | None:
        if leaf == "bias":
            return None  # replicated, added once after the all-reduce
        return self.scheme.row_slice(leaf, self.part)

    def full_weight_shape(self, shard: str | None) -> tuple[int, int]:
        return (self.out_features, self.part.full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.scheme.apply(self, x)
        if self.tp.is_parallel:
            y = self.tp.all_reduce(y)
        return self._add_bias(y)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the product, before the sum over the ranks (RowLinear.partial)."""
        return self.scheme.apply(self, x)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return self._add_bias(y)


def make_scheme(spec: QuantSpec) -> LinearScheme:
    if spec.method == "awq":
        from engine.model.quant.awq import AWQScheme

        return AWQScheme(spec.group_size)
    from engine.model.quant.fp8 import Fp8Scheme

    return Fp8Scheme(spec.prequantized)


def quantize_linears(model: nn.Module, spec: QuantSpec) -> int:
    """Replace every MergedLinear / ColumnLinear / RowLinear of a model being built (meta device) by its
    quantized form with the same split; returns how many.  ValueError when a split cannot be stored."""
    scheme = make_scheme(spec)
    count = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            replacement: nn.Module | None = None
            if isinstance(child, MergedLinear) and type(child) in (MergedLinear, ColumnLinear):  # not a subclass
                replacement = QuantMergedLinear(child.in_features, dict(child.parts), child.bias is not None, scheme)
            elif type(child) is RowLinear:
                replacement = QuantRowLinear(
                    child.part.full, child.out_features, child.bias is not None, scheme, child.tp
                )
            if replacement is not None:
                setattr(parent, child_name, replacement)
                count += 1
    return count


def quantized_layers(model: nn.Module) -> list[_QuantLinear]:
    return [m for m in model.modules() if isinstance(m, _QuantLinear)]
