"""Linear layers on the CPU at the speed the CPU allows for their weights' type.

Two cases, chosen per weight dtype at load:
- **Packed** (float32 wherever torch has oneDNN; bf16 / fp16 where the CPU has oneDNN's instructions for the type:
  AVX-512 bf16, AMX): `F.linear` reorders a bf16 weight into oneDNN's blocked layout on every call, a pass over the
  whole weight that costs as much as a decode step's product, and MKL's float32 product of 3 to about 64 rows packs
  the weight on every call as well (2-3x slower than packed from 4 to 32 rows); the weight is reordered once
  (`torch.ops.mkldnn._reorder_linear_weight`, as torch's CPU inductor does) and the packed product called
  (`_linear_pointwise`), as vLLM's CPU build does with its own oneDNN handler (docs/decisions/cpu-packing.md).
  On an AVX-512 host a float32 layer also keeps a panel-packed copy that products of few rows (a decode step) read
  at stream speed, where oneDNN's product is slower (kernels/cpu_linear.py, docs/decisions/cpu-linear.md).
- **Widened** (no such instructions: AVX2, or AVX-512 without its bf16 extension): torch's bf16 matmul of more
  than one row takes an emulated path 5-7x slower than float32, and so does oneDNN's packed one; the product runs
  in float32 over the bf16 weight widened for the call (the same bf16 values, summed in float32 as the native path
  sums them) and is rounded back.  One row (a decode step of one
  sequence) keeps the bf16 product, which is a fast matrix-vector loop there (docs/decisions/cpu-packing.md).

Either way the products are summed in a different order than the plain call, so a near-tie between two tokens of
a random-weight model can flip.  The plain float32 call is no fixed order either: MKL sums a row one way below 16
rows and another from 16, so a sequence's numbers already depended on how many others shared its step; the packed
product gives each row the same numbers whatever the batch.

The layer's forward is replaced by the product, with the tensor-parallel all-gather its own forward would do; a
row-parallel layer of a tensor-parallel model keeps its forward (the sum over the ranks, then the bias) and has its
`partial` product replaced.  A packed weight replaces the layer's parameter (no second copy of the model in memory).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.linear import MergedLinear, RowLinear, VocabEmbedding
from kernels import cpu_linear

PACKED_DTYPES = (torch.bfloat16, torch.float16)  # packed where the CPU has the instructions, else widened
_ROWS_HINT = 64  # oneDNN picks its blocking for this many rows; any number of rows works


def native_bf16() -> bool:
    """The CPU multiplies bf16 in hardware (AVX-512 bf16 or AMX).  oneDNN's own check also says yes on AVX-512
    without them, where its packed bf16 product is emulated: 3-4x slower than float32 from 8 rows up on such an
    Intel Xeon (docs/decisions/cpu-packing.md).  Where this torch cannot tell, oneDNN's check stands."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(check is None for check in checks):
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return any(bool(check()) for check in checks if check is not None)


def packing_available(dtype: torch.dtype) -> bool:
    """oneDNN is built in and this CPU has the instructions for `dtype` (else its emulation is slower than MKL;
    float32 needs none beyond what oneDNN requires of any x86 CPU)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype not in PACKED_DTYPES:
        return False
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and native_bf16()
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


class _PackedProduct:
    """``x @ W^T (+ bias)`` over oneDNN's packed copy of W; up to `few_rows` rows (a decode step) over a second,
    panel-packed copy when the layer has one (kernels/cpu_linear.py: read at stream speed, where oneDNN is not)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT)
        self.bias = bias
        self.out_features = weight.shape[0]
        self.panels: torch.Tensor | None = None
        self.few_rows = 0

    def add_panels(self, weight: torch.Tensor, few_rows: int) -> None:
        self.panels = cpu_linear.pack(weight)
        self.few_rows = few_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.numel() <= self.few_rows * x.shape[-1]:
            return cpu_linear.linear(x, self.panels, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class _WidenedProduct:
    """``x @ W^T (+ bias)`` in float32 over W widened block by block, rounded back to x's dtype; one row in x's own
    dtype.  Each block of W's rows (about `WIDEN_BLOCK_BYTES` in float32) is widened into a scratch buffer the
    thread reuses and multiplied while it is in cache: widening all of W for each call allocated and wrote a float32
    copy of it (for a 32k-vocabulary head, slower than the float32 product itself); block by block the product reads
    W's bf16 bytes once and runs at or above float32's speed.  W stays the layer's parameter (no copy at load)."""

    packed = None  # the layer keeps its own weight

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach()
        self.bias = bias
        self.bias32 = None if bias is None else bias.detach().float()
        self.block_rows = max(1, WIDEN_BLOCK_BYTES // (4 * self.weight.shape[1]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= x.shape[-1]:  # one row: the plain product is a fast matrix-vector loop
            return F.linear(x, self.weight, self.bias)
        w = self.weight
        rows_t = x.reshape(-1, x.shape[-1]).float().t()
        out_t = torch.empty(w.shape[0], rows_t.shape[1])  # (out features, rows): each block's rows are contiguous
        scratch = _scratch(self.block_rows * w.shape[1]).view(self.block_rows, w.shape[1])
        for start in range(0, w.shape[0], self.block_rows):
            stop = min(w.shape[0], start + self.block_rows)
            block = scratch[: stop - start]
            block.copy_(w[start:stop])
            torch.mm(block, rows_t, out=out_t[start:stop])
        out = out_t.t()
        if self.bias32 is not None:
            out = out + self.bias32
        return out.to(x.dtype, memory_format=torch.contiguous_format).view(*x.shape[:-1], w.shape[0])


WIDEN_BLOCK_BYTES = 2 << 20  # a float32 block of W: 1-4 MiB measured fastest (docs/decisions/cpu-packing.md)
_scratches = threading.local()


def _scratch(elements: int) -> torch.Tensor:
    """This thread's float32 buffer of at least `elements` (one per thread: a step may run on any one thread)."""
    buf: torch.Tensor | None = getattr(_scratches, "buf", None)
    if buf is None or buf.numel() < elements:
        # a normal tensor even when made under inference mode (the engine's steps): an inference tensor cannot be
        # written outside inference mode, where a product may be called later (a test, a benchmark)
        with torch.inference_mode(False):
            buf = _scratches.buf = torch.empty(max(elements, WIDEN_BLOCK_BYTES // 4))
    return buf[:elements]


Product = _PackedProduct | _WidenedProduct
Maker = Callable[[torch.Tensor, "torch.Tensor | None"], Product]


def product_kind(dtype: torch.dtype) -> str | None:
    """How a CPU linear layer of `dtype` runs here: "packed", "widened" or None (plain: no oneDNN)."""
    if packing_available(dtype):
        return "packed"
    if dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available():
        return "widened"
    return None


def _replace_weight(layer: nn.Module, product: Product) -> None:
    """Drop the plain weight for the packed one (the same numbers), keeping its shape and dtype readable."""
    if product.packed is not None:
        layer.weight = nn.Parameter(product.packed, requires_grad=False)


FEW_ROWS = 16  # a decoder layer's product of up to this many rows takes the panel copy (docs/decisions/cpu-linear.md)
HEAD_FEW_ROWS = 4  # the LM head's: above it oneDNN's product was as fast or faster


def _maker(kind: str, panels: bool) -> tuple[Maker, Maker]:
    """The product makers for decoder layers and for the LM head: oneDNN's packed product, with the panel copy for
    few rows where `panels`, or the widened one."""
    if kind != "packed":
        return _WidenedProduct, _WidenedProduct

    def make(few_rows: int) -> Maker:
        def build(weight: torch.Tensor, bias: torch.Tensor | None) -> Product:
            product = _PackedProduct(weight, bias)
            if panels and weight.dtype == torch.float32:
                product.add_panels(weight, few_rows)
            return product

        return build

    return make(FEW_ROWS), make(HEAD_FEW_ROWS)


def panel_bytes(model: nn.Module) -> int:
    """Bytes of the panel copies `pack_linears` added to `model` (memory beyond its weights)."""
    total = 0
    for module in model.modules():
        for product in (getattr(module, "forward", None), getattr(module, "partial", None), _head_product(module)):
            panels = getattr(product, "panels", None)
            if isinstance(panels, torch.Tensor):
                total += panels.numel() * panels.element_size()
    return total


def _head_product(module: nn.Module) -> object:
    logits = getattr(module, "logits", None)
    return getattr(logits, "product", None)


def pack_linears(model: nn.Module, weights_shared: bool = False) -> int:
    """Give every linear layer of `model` whose weight dtype needs it the faster product (packed or widened);
    returns how many layers got one.  A tied LM head (the embedding's weight) is never packed: the embedding
    lookup needs the plain rows (widening keeps them, so a tied head is widened).  `weights_shared`: the weights are
    a keeper's, mapped by every engine (engine/keeper/); a packed copy would be this process's own, so those layers
    keep the plain product and the one shared copy (widening copies nothing and still applies)."""
    count = 0
    panels = cpu_linear.available()  # float32 decode steps over a second copy (kernels/cpu_linear.py)
    tied = {id(m) for m in model.modules() if isinstance(m, VocabEmbedding) and _is_embedding(model, m)}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu":
            continue
        kind = product_kind(weight.dtype)
        if kind is None or (kind == "packed" and weights_shared):
            continue
        make, make_head = _maker(kind, panels)
        if isinstance(module, RowLinear):
            _pack_row(module, make)
        elif isinstance(module, MergedLinear):
            _pack_column(module, make)
        elif isinstance(module, VocabEmbedding) and (kind == "widened" or id(module) not in tied):
            _pack_head(module, make_head)
        else:
            continue
        count += 1
    return count


def _is_embedding(model: nn.Module, module: nn.Module) -> bool:
    """The module looks tokens up (an input embedding), not only scores them (an untied LM head)."""
    return any(name.endswith("embed_tokens") for name, m in model.named_modules() if m is module)


def _pack_column(layer: MergedLinear, make: Maker) -> None:
    product = make(layer.weight, layer.bias)
    _replace_weight(layer, product)
    layer.forward = product  # type: ignore[assignment]  # nn.Linear.forward names its argument `input`


def _pack_row(layer: RowLinear, make: Maker) -> None:
    if not layer.tp.is_parallel:
        product = make(layer.weight, layer.bias)
        _replace_weight(layer, product)
        layer.forward = product  # type: ignore[method-assign]
        return
    partial = make(layer.weight, None)  # the bias is added once, after the sum (RowLinear.forward)
    _replace_weight(layer, partial)
    layer.partial = partial  # type: ignore[method-assign]


def _pack_head(head: VocabEmbedding, make: Maker) -> None:
    product = make(head.weight, None)
    _replace_weight(head, product)

    def logits(self: VocabEmbedding, hidden: torch.Tensor) -> torch.Tensor:
        local = product(hidden)
        if not self.tp.is_parallel:
            return local
        return self.tp.all_gather_last(local)[..., : self.vocab_size]

    logits.product = product  # type: ignore[attr-defined]  # panel_bytes finds the head's copy here
    head.logits = types.MethodType(logits, head)  # type: ignore[method-assign]
