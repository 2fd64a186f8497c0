"""CPU linear layers packed once into oneDNN's layout give the same products as the plain ones (up to bf16
summation order) and the engine's greedy tokens stay those of the unpacked model almost everywhere."""

from __future__ import annotations

import pytest
import torch

from engine.model.cpu_packing import pack_linears, packing_available
from engine.model.layers.linear import MergedLinear, RowLinear, VocabEmbedding
from engine.parallel.group import SINGLE

pytestmark = pytest.mark.skipif(not packing_available(torch.bfloat16), reason="this CPU has no oneDNN bf16")


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


@pytest.mark.parametrize("tied", [False, True])
def test_packed_layers_compute_what_the_plain_ones_did(tied: bool) -> None:
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


def test_float32_is_left_to_mkl() -> None:
    model = _Tiny(tied=False)
    assert pack_linears(model) == 0 and not model.qkv.weight.is_mkldnn
