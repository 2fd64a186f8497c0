"""CPU linear layers packed once into oneDNN's layout give the same products as the plain ones (up to summation
order) and the engine's greedy tokens stay those of the unpacked model almost everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.cpu_packing import pack_linears
from engine.model.layers.linear import MergedLinear, RowLinear, VocabEmbedding
from engine.parallel.group import SINGLE

# oneDNN's packed bf16 product runs wherever oneDNN says bf16 is supported (emulated without the instructions); the
# engine takes it only where the CPU has them (cpu_packing.native_bf16), so the packed tests force that choice.
needs_onednn_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="this CPU has no oneDNN bf16",
)


@pytest.fixture
def packs_bf16(monkeypatch):
    from engine.model import cpu_packing

    monkeypatch.setattr(cpu_packing, "native_bf16", lambda: True)


class _Tiny(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(300, 64)
        self.qkv = MergedLinear(64, {"q": 64, "k": 32, "v": 32}, bias=True)
        self.o = RowLinear(64, 64, bias=False, tp=SINGLE)
        self.lm_head = None if tied else VocabEmbedding(300, 64)

    def run(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        x = self.o(self.qkv(x)[:, :64])
        return (self.embed_tokens if self.lm_head is None else self.lm_head).logits(x)


@needs_onednn_bf16
@pytest.mark.parametrize("tied", [False, True])
def test_packed_layers_compute_what_the_plain_ones_did(tied: bool, packs_bf16) -> None:
    torch.manual_seed(0)
    model = _Tiny(tied)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, 300, (10,))
    with torch.no_grad():
        plain = model.run(ids).float()
        packed = pack_linears(model)
        after = model.run(ids).float()
    assert packed == (2 if tied else 3)  # a tied head stays plain: the embedding lookup needs its rows
    assert model.qkv.weight.is_mkldnn and not model.embed_tokens.weight.is_mkldnn
    err = (after - plain).abs().max().item()
    print(f"tied={tied}: {packed} layers packed, max |logit difference| {err:.2e} (logits ~{plain.abs().mean():.2f})")
    assert err <= 2e-2 * plain.abs().max().item()


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@needs_onednn
def test_float32_layers_are_packed_and_give_each_row_the_same_numbers_whatever_the_batch() -> None:
    """float32 layers take oneDNN's packed product as well: MKL's plain product of 3 to about 64 rows packs the weight
    on every call.  Its numbers stay within float32 rounding of the plain product, and each row's are the same
    whether it is computed alone or among others (MKL's own sums change order at 16 rows).  Up to 16 rows take the
    panel copy on an AVX-512 host (kernels/cpu_linear.py), which sums in oneDNN's order for a K of one 512-k block
    as here (K = 64); past one block the two differ by float32 rounding (tests/kernels/test_cpu_linear.py)."""
    torch.manual_seed(0)
    model = _Tiny(tied=False)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ids = torch.randint(0, 300, (24,))
    with torch.no_grad():
        plain = model.run(ids)
        assert pack_linears(model) == 3
        assert model.qkv.weight.is_mkldnn and model.lm_head.weight.is_mkldnn
        after = model.run(ids)
        torch.testing.assert_close(after, plain, rtol=1e-5, atol=1e-5)
        for rows in (1, 2, 5, 16):
            assert torch.equal(model.run(ids[:rows]), after[:rows]), rows


@needs_onednn
def test_a_keepers_shared_weights_are_not_copied_into_packed_ones() -> None:
    """Weights a keeper shares with every engine (engine/keeper/) stay the layers' own: a packed copy would be one
    more copy of the model per engine.  Widened products copy nothing and still apply."""
    model = _Tiny(tied=False)
    weight = model.qkv.weight
    assert pack_linears(model, weights_shared=True) == 0
    assert model.qkv.weight is weight and not weight.is_mkldnn and "forward" not in vars(model.qkv)
    widened = _Tiny(tied=True).to(torch.bfloat16)
    from engine.model import cpu_packing

    if cpu_packing.product_kind(torch.bfloat16) == "widened":
        assert pack_linears(widened, weights_shared=True) == 3


def test_bf16_is_packed_only_where_the_cpu_multiplies_bf16_itself(monkeypatch) -> None:
    """oneDNN says bf16 is supported on any AVX-512 CPU, but without AVX-512 bf16 or AMX its packed product is
    emulated (3-4x slower than float32 from 8 rows up on an Intel Xeon without them): widened there instead."""
    from engine.model import cpu_packing

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    for avx512_bf16, amx, want in ((False, False, "widened"), (True, False, "packed"), (False, True, "packed")):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        if torch.backends.mkldnn.is_available():
            assert cpu_packing.product_kind(torch.bfloat16) == want
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")  # a torch that cannot tell: oneDNN's check stands
    assert cpu_packing.native_bf16() is True


def test_without_the_instructions_bf16_products_run_widened_to_float32(monkeypatch) -> None:
    """On a CPU without oneDNN bf16 (AVX2 only), torch's bf16 matmul of many rows is emulated, 5-7x slower than
    float32: the layers compute in float32 over the same bf16 weights, rounded back to bf16; one row keeps the bf16
    product.  Forced here so that the test runs on either kind of CPU."""
    from engine.model import cpu_packing

    monkeypatch.setattr(cpu_packing, "packing_available", lambda dtype: False)
    torch.manual_seed(0)
    model = _Tiny(tied=True)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    model = model.to(torch.bfloat16)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert cpu_packing.product_kind(torch.bfloat16) == "widened"
    with torch.no_grad():
        assert pack_linears(model) == 3  # the tied head too: widening keeps the embedding's rows
        for name, p in model.named_parameters():  # no weight replaced, no copy kept
            assert p.dtype == torch.bfloat16 and torch.equal(p, weights[name]), name
        x = torch.randn(10, 64).bfloat16()

        def float32_product(name: str, rows: torch.Tensor) -> torch.Tensor:
            bias = weights.get(f"{name}.bias")
            return F.linear(rows.float(), weights[f"{name}.weight"].float(), None if bias is None else bias.float())

        def assert_rounded_float32(got: torch.Tensor, want: torch.Tensor) -> None:
            # float32 sums (in MKL's order, block by block) rounded to bf16: within one bf16 step of the float32 value
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-6)

        assert_rounded_float32(model.qkv(x), float32_product("qkv", x))
        assert_rounded_float32(model.o(x), float32_product("o", x))
        batched = x.view(2, 5, 64)  # leading dimensions are kept
        assert_rounded_float32(model.qkv(batched), float32_product("qkv", batched))
        one = x[:1]
        assert torch.equal(model.qkv(one), F.linear(one, weights["qkv.weight"], weights["qkv.bias"]))
        ids = torch.randint(0, 300, (10,))
        hidden = model.embed_tokens(ids)
        assert torch.equal(hidden, F.embedding(ids, weights["embed_tokens.weight"]))
        assert_rounded_float32(model.embed_tokens.logits(hidden), float32_product("embed_tokens", hidden))


def test_a_widened_product_wider_than_one_block_covers_every_row(monkeypatch) -> None:
    """The weight is widened block by block into one reused buffer: a weight of several blocks and a last, partial
    block give the float32 product (rounded) in every output column."""
    from engine.model import cpu_packing

    monkeypatch.setattr(cpu_packing, "WIDEN_BLOCK_BYTES", 4 * 64 * 7)  # 7 rows of W per block
    torch.manual_seed(1)
    w = (torch.randn(30, 64) * 0.1).bfloat16()
    b = torch.randn(30).bfloat16()
    x = torch.randn(6, 64).bfloat16()
    product = cpu_packing._WidenedProduct(w, b)
    assert product.block_rows == 7
    want = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(product(x).float(), want, rtol=2**-7, atol=1e-6)
    assert product(x).is_contiguous()


def test_without_onednn_float32_layers_keep_the_plain_product(monkeypatch) -> None:
    from engine.model import cpu_packing

    monkeypatch.setattr(cpu_packing, "packing_available", lambda dtype: False)
    model = _Tiny(tied=False)
    assert pack_linears(model) == 0 and "forward" not in vars(model.qkv)


def test_the_scratch_made_in_inference_mode_serves_products_outside_it() -> None:
    """The engine's steps run under inference mode; the thread's scratch made there must still take writes outside
    it (a benchmark in the same process failed: "Inplace update to inference tensor outside InferenceMode")."""
    import threading

    from engine.model import cpu_packing

    def run() -> None:
        product = cpu_packing._WidenedProduct((torch.randn(8, 16) * 0.1).bfloat16(), None)
        x = torch.randn(3, 16).bfloat16()
        with torch.inference_mode():
            inside = product(x)
        with torch.no_grad():
            outside = product(x)
        assert torch.equal(inside, outside)
        done.append(True)

    done: list[bool] = []
    worker = threading.Thread(target=run)  # a fresh thread: its scratch is first made under inference mode
    worker.start()
    worker.join(60)
    assert done == [True]
