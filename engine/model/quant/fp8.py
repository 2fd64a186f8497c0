"""FP8 weights: float8_e4m3fn with one float32 scale per output channel; activations per token.

Why per channel: one scale per output row is what torch._scaled_mm's row-wise mode applies for free
in the GEMM epilogue, and it keeps each row's largest value at the top of e4m3's range (a per-tensor
scale wastes range on every row smaller than the largest).  A 16-bit checkpoint is quantized while
it loads, one tensor (one fused shard) at a time on the device, so no full 16-bit copy of the model
is ever held.  A row-parallel rank quantizes its own slice of each row: its scales are its slice's,
which is exact for its partial product.

Serialized FP8 checkpoints keep their scales: per tensor (vLLM's `fp8`, compressed-tensors
`strategy: tensor`) becomes that value on every row of the shard; per channel is sliced with the
rows.  A static `input_scale` is checked and not used: activations are scaled per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

import kernels
from engine.config import ConfigError
from engine.model.layers.linear import CheckpointSlice
from engine.model.weights import FLOAT_DTYPES, CheckpointTensor, ModelLoadError, check_shape
from engine.parallel.group import Part, TPGroup
from kernels.quant_reference import quantize_rows

if TYPE_CHECKING:
    from engine.model.quant.layers import _QuantLinear  # which imports this module

FP8 = torch.float8_e4m3fn


class Fp8Scheme:
    def __init__(self, prequantized: bool) -> None:
        self.prequantized = prequantized

    def create(self, layer: _QuantLinear, in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def leaves(self, bias: bool) -> list[str]:
        return ["weight"] + (["weight_scale"] if self.prequantized else []) + (["bias"] if bias else [])

    def column_slice(self, leaf: str, part: Part, dest: int) -> CheckpointSlice:
        return CheckpointSlice(0, part.start, part.size, part.full, dest)

    def row_slice(self, leaf: str, part: Part) -> CheckpointSlice | None:
        return CheckpointSlice(1, part.start, part.size, part.full) if leaf == "weight" else None

    def check_column(self, parts: dict[str, Part], offsets: dict[str, tuple[int, int]]) -> None:
        """Any split of output channels works: each channel has its own scale."""

    def check_row(self, part: Part, tp: TPGroup) -> None:
        """Any split of input features works: each rank scales its own slice."""

    def load(
        self, layer: _QuantLinear, raw_name: str, leaf: str, where: CheckpointSlice | None, tensor: CheckpointTensor
    ) -> bool:
        if leaf == "weight":
            if tensor.dtype == "F8_E4M3" and self.prequantized:
                return False  # stored as it is (the plain copy checks its shape)
            if tensor.dtype in FLOAT_DTYPES and not self.prequantized:
                self._quantize_into(layer, raw_name, where, tensor)
                return True
            wants = "float8_e4m3fn (F8_E4M3)" if self.prequantized else "a 16- or 32-bit float"
            raise ModelLoadError(
                f"checkpoint weight {raw_name} is {tensor.dtype or 'of unknown type'}, expected {wants} "
                "for an FP8 model: config.json's quantization_config does not match the weights"
            )
        if leaf == "weight_scale" and self.prequantized:
            self._load_scale(layer, raw_name, where, tensor)
            return True
        if leaf == "input_scale" and self.prequantized:
            if len(tensor.shape) > 1 or (tensor.shape and tensor.shape[0] != 1):
                raise ModelLoadError(
                    f"checkpoint weight {raw_name} has shape {tensor.shape}, a static input scale is one value"
                )
            return True  # activations are scaled per token at run time (see the module docstring)
        return False

    @torch.no_grad()
    def _quantize_into(
        self, layer: _QuantLinear, raw_name: str, where: CheckpointSlice | None, tensor: CheckpointTensor
    ) -> None:
        weight, scale = layer.get_parameter("weight"), layer.get_parameter("weight_scale")
        full = list(weight.shape)
        if where is not None:
            full[where.dim] = where.full
        check_shape(raw_name, tensor.shape, tuple(full))
        data = tensor.read() if where is None else tensor.read(where.dim, where.start, where.size)
        q, s = quantize_rows(data.to(weight.device))
        if where is not None and where.dim == 0:  # this shard's rows
            weight.narrow(0, where.dest, where.size).copy_(q)
            scale.narrow(0, where.dest, where.size).copy_(s)
        else:  # every row (a row-parallel rank's slice of each)
            weight.copy_(q)
            scale.copy_(s)

    @torch.no_grad()
    def _load_scale(
        self, layer: _QuantLinear, raw_name: str, where: CheckpointSlice | None, tensor: CheckpointTensor
    ) -> None:
        scale = layer.get_parameter("weight_scale")
        rows = where.full if where is not None else scale.shape[0]
        per_tensor = tensor.shape in ((), (1,), (1, 1))
        if not per_tensor and tensor.shape not in ((rows,), (rows, 1)):
            raise ModelLoadError(
                f"checkpoint weight {raw_name} has shape {tensor.shape}: an FP8 weight scale is per tensor "
                f"([] or [1]) or per output channel ([{rows}] or [{rows}, 1])"
            )
        if tensor.dtype and tensor.dtype not in FLOAT_DTYPES:
            raise ModelLoadError(f"checkpoint weight {raw_name} is {tensor.dtype}, an FP8 weight scale is a float")
        target = scale if where is None else scale.narrow(0, where.dest, where.size)
        if per_tensor:
            target.copy_(tensor.read().reshape(1).float().expand(target.shape[0]))
        elif where is None:
            target.copy_(tensor.read().reshape(-1))
        else:
            target.copy_(tensor.read(0, where.start, where.size).reshape(-1))

    def from_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.prequantized:
            return {"weight": weight}  # quantized while it loads, as a 16-bit checkpoint's
        q, scale = quantize_rows(weight)
        return {"weight": q, "weight_scale": scale}

    def apply(self, layer: _QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return kernels.quant_backend(x.device).fp8_linear(x, layer.weight, layer.weight_scale)

    def finish(self, layer: _QuantLinear) -> None:
        weight = layer.weight
        if weight.device.type == "cuda" and (weight.shape[0] % 16 or weight.shape[1] % 16):
            raise ConfigError(
                f"--quantization fp8 on the GPU needs layer widths divisible by 16 (torch._scaled_mm); a layer "
                f"here is {weight.shape[0]} x {weight.shape[1]} on this rank"
            )
