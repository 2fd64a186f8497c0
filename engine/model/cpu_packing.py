"""Linear layers on the CPU through oneDNN with weights reordered once, at load, into its blocked layout.

`F.linear` on a bf16 CPU tensor goes through oneDNN too, but reorders the weight into oneDNN's blocked (AMX / AVX-512)
layout on every call: for a decode step's few rows that reorder, a pass over the whole weight, costs as much as the
product.  Reordering once at load (`torch.ops.mkldnn._reorder_linear_weight`, the packing torch's own CPU inductor uses)
and calling the packed product (`_linear_pointwise`) is 1.5-2x faster for a decode step's few rows
(docs/decisions/cpu-packing.md).  The results are bf16 products summed in float32 either way, but not always in the same
order as the unpacked call, so a near-tie between two tokens of a random-weight model can flip (greedy tokens of a
512-wide test model first differed at one token in 128).  float32 weights are left to MKL: the reference path's float32
numbers are what the parity tests compare with transformers.

A packed weight replaces the layer's parameter (no second copy of the model in memory); the layer's forward is
replaced by the packed product, with the tensor-parallel all-gather its own forward would do; a row-parallel
layer of a tensor-parallel model keeps its forward (the sum over the ranks, then the bias) and has its `partial`
product replaced.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from engine.model.layers.linear import MergedLinear, RowLinear, VocabEmbedding

PACKED_DTYPES = (torch.bfloat16, torch.float16)
_ROWS_HINT = 64  # oneDNN picks its blocking for this many rows; any number of rows works


def packing_available(dtype: torch.dtype) -> bool:
    """oneDNN is built in and this CPU has the instructions for `dtype` (else its emulation is slower than MKL)."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


class _PackedProduct:
    """``x @ W^T (+ bias)`` over oneDNN's packed copy of W."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _replace_weight(layer: nn.Module, product: _PackedProduct) -> None:
    """Drop the plain weight (the packed one holds the same numbers), keeping its shape and dtype readable."""
    layer.weight = nn.Parameter(product.packed, requires_grad=False)


def pack_linears(model: nn.Module) -> int:
    """Pack every linear layer of `model` whose weight dtype oneDNN handles; returns how many were packed.
    A tied LM head (the embedding's weight) is left alone: the embedding lookup needs the plain rows."""
    count = 0
    tied = {id(m) for m in model.modules() if isinstance(m, VocabEmbedding) and _is_embedding(model, m)}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" or not packing_available(weight.dtype):
            continue
        if isinstance(module, RowLinear):
            _pack_row(module)
        elif isinstance(module, MergedLinear):
            _pack_column(module)
        elif isinstance(module, VocabEmbedding) and id(module) not in tied:
            _pack_head(module)
        else:
            continue
        count += 1
    return count


def _is_embedding(model: nn.Module, module: nn.Module) -> bool:
    """The module looks tokens up (an input embedding), not only scores them (an untied LM head)."""
    return any(name.endswith("embed_tokens") for name, m in model.named_modules() if m is module)


def _pack_column(layer: MergedLinear) -> None:
    product = _PackedProduct(layer.weight, layer.bias)
    _replace_weight(layer, product)
    layer.forward = product  # type: ignore[assignment]  # nn.Linear.forward names its argument `input`


def _pack_row(layer: RowLinear) -> None:
    if not layer.tp.is_parallel:
        product = _PackedProduct(layer.weight, layer.bias)
        _replace_weight(layer, product)
        layer.forward = product  # type: ignore[method-assign]
        return
    partial = _PackedProduct(layer.weight, None)  # the bias is added once, after the sum (RowLinear.forward)
    _replace_weight(layer, partial)
    layer.partial = partial  # type: ignore[method-assign]


def _pack_head(head: VocabEmbedding) -> None:
    product = _PackedProduct(head.weight, None)
    _replace_weight(head, product)

    def logits(self: VocabEmbedding, hidden: torch.Tensor) -> torch.Tensor:
        local = product(hidden)
        if not self.tp.is_parallel:
            return local
        return self.tp.all_gather_last(local)[..., : self.vocab_size]

    head.logits = types.MethodType(logits, head)  # type: ignore[method-assign]
