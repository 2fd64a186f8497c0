"""AWQ int4 weights in AutoAWQ's GEMM layout (kernels/quant_reference.py has the format).

Loaded strictly: `qweight` and `qzeros` must be int32, `scales` a float, and every tensor's shape
must be what the group size and the layer say, or the error names the tensor and both shapes.

Tensor parallelism splits the packed tensors along the same dimensions as the unquantized weight:
a column-parallel rank takes its output columns, which in the packed tensors are words of eight,
so every split point must fall on a multiple of 8; a row-parallel rank takes its input rows, whose
zero points and scales come in groups, so its share must be a whole number of groups.  A
`--tensor-parallel-size` that breaks either is refused, naming the sizes that work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

import kernels
from engine.config import ConfigError
from engine.model.layers.linear import CheckpointSlice
from engine.model.weights import FLOAT_DTYPES, CheckpointTensor, ModelLoadError, copy_into
from engine.parallel.group import Part, TPGroup

if TYPE_CHECKING:
    from engine.model.quant.layers import _QuantLinear  # which imports this module

PACK = 8  # int4 values per int32
_PACKED = ("qweight", "qzeros")


class AWQScheme:
    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create(self, layer: _QuantLinear, in_features: int, out_features: int, bias: bool) -> None:
        g = self.group_size
        if in_features % g:
            raise ValueError(
                f"AWQ group size {g} does not divide a layer's {in_features} input features: the checkpoint's "
                "quantization_config does not fit this model"
            )
        if out_features % PACK:
            raise ValueError(f"AWQ packs {PACK} output columns per int32; a layer has {out_features} outputs")

        def int32(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=torch.int32), requires_grad=False)

        layer.qweight = int32(in_features, out_features // PACK)
        layer.qzeros = int32(in_features // g, out_features // PACK)
        layer.scales = nn.Parameter(torch.empty(in_features // g, out_features), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def leaves(self, bias: bool) -> list[str]:
        return ["qweight", "qzeros", "scales"] + (["bias"] if bias else [])

    def column_slice(self, leaf: str, part: Part, dest: int) -> CheckpointSlice:
        if leaf in _PACKED:
            return CheckpointSlice(1, part.start // PACK, part.size // PACK, part.full // PACK, dest // PACK)
        if leaf == "scales":
            return CheckpointSlice(1, part.start, part.size, part.full, dest)
        return CheckpointSlice(0, part.start, part.size, part.full, dest)  # bias

    def row_slice(self, leaf: str, part: Part) -> CheckpointSlice | None:
        if leaf == "qweight":
            return CheckpointSlice(0, part.start, part.size, part.full)
        if leaf in ("qzeros", "scales"):
            g = self.group_size
            return CheckpointSlice(0, part.start // g, part.size // g, part.full // g)
        return None

    def check_column(self, parts: dict[str, Part], offsets: dict[str, tuple[int, int]]) -> None:
        for name, part in parts.items():
            if any(v % PACK for v in (part.full, part.start, part.size, offsets[name][0])):
                raise ValueError(
                    f"AWQ packs {PACK} output columns per int32, and this --tensor-parallel-size gives a rank "
                    f"{part.size} of a projection's {part.full} output columns (from column {part.start}), which does "
                    f"not fall on whole int32 words; use a size whose share of {part.full} is a multiple of {PACK}"
                )

    def check_row(self, part: Part, tp: TPGroup) -> None:
        g = self.group_size
        if part.size % g:
            works = [t for t in range(1, part.full // g + 1) if part.full % t == 0 and (part.full // t) % g == 0]
            raise ValueError(
                f"--tensor-parallel-size {tp.size} gives each rank {part.size} of a row-parallel layer's {part.full} "
                f"input features, not a whole number of AWQ groups of {g}; sizes that split it into whole groups: "
                f"{', '.join(map(str, works))}"
            )

    def load(
        self, layer: _QuantLinear, raw_name: str, leaf: str, where: CheckpointSlice | None, tensor: CheckpointTensor
    ) -> bool:
        if leaf in _PACKED and tensor.dtype and tensor.dtype != "I32":
            raise ModelLoadError(
                f"checkpoint weight {raw_name} is {tensor.dtype}; AWQ's {leaf} holds eight 4-bit values per int32 "
                "(I32): this is not an AutoAWQ GEMM checkpoint"
            )
        if leaf == "scales" and tensor.dtype and tensor.dtype not in FLOAT_DTYPES:
            raise ModelLoadError(f"checkpoint weight {raw_name} is {tensor.dtype}; AWQ's scales are float16")
        if leaf not in self.leaves(True):
            return False
        param = getattr(layer, leaf)
        full = list(param.shape)
        if where is not None:
            full[where.dim] = where.full
        if tuple(tensor.shape) != tuple(full):
            raise ModelLoadError(
                f"checkpoint weight {raw_name} has shape {tensor.shape}, AWQ with group size {self.group_size} "
                f"expects {tuple(full)}: config.json's quantization_config does not match the weights"
            )
        copy_into(param.data, where, tensor, raw_name)
        return True

    def from_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Round to nearest, as engine/model/quantize.py writes checkpoints."""
        from engine.model.quantize import awq_quantize

        return awq_quantize(weight, self.group_size)

    def apply(self, layer: _QuantLinear, x: torch.Tensor) -> torch.Tensor:
        backend = kernels.quant_backend(x.device)
        packed = getattr(layer, "awq_tc_packed", None)
        if packed is not None:
            return backend.awq_linear(x, None, None, layer.scales, self.group_size, repacked=(packed, layer.awq_tc_zf))
        return backend.awq_linear(x, layer.qweight, layer.qzeros, layer.scales, self.group_size)

    def finish(self, layer: _QuantLinear) -> None:
        if layer.qweight is None or layer.qweight.device.type != "cuda":  # None: repacked already
            return
        if self.group_size % 16:
            raise ConfigError(
                f"AWQ group size {self.group_size} on the GPU: the Triton kernel needs a multiple of 16 (32, 64, 128)"
            )
        from kernels import quant_cuda
        from kernels.w4a16_tc import BLOCK_ROWS, awq_repack

        # kernels/w4a16_tc.py's layout *instead of* the checkpoint's: every GPU product reads it (quant_cuda.awq_path),
        # so the layer keeps one int4 copy, as many bytes as qweight (a keeper's shared qweight stays the keeper's)
        qweight, qzeros = layer.qweight, layer.qzeros
        assert isinstance(qweight, torch.Tensor) and isinstance(qzeros, torch.Tensor)
        if quant_cuda.KERNELS != "legacy" and qweight.shape[0] % BLOCK_ROWS == 0:
            packed, zf = awq_repack(qweight.data, qzeros.data, self.group_size)
            layer.register_buffer("awq_tc_packed", packed, persistent=False)
            layer.register_buffer("awq_tc_zf", zf, persistent=False)
            layer.register_parameter("qweight", None)
            layer.register_parameter("qzeros", None)
