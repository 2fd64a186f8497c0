"""The few-row CPU product (kernels/csrc/cpu_linear.cpp through kernels/cpu_linear.py) and its use by the CPU's
linear layers (engine/model/cpu_packing.py).

The product against a float64 reference on shapes that exercise every edge: N no multiple of the 32-wide panel, K
no multiple of anything and above the 512-k block, row counts on both sides of the 12-row tile, a bias, x rows with
a stride.  Its numbers must not depend on the rows beside a row or on the thread count (a sequence's tokens must not
depend on the batch it shared a step with).  In the layers: up to `FEW_ROWS` rows take it, more take oneDNN's
product, the two agree to float32 rounding, `PAGEKEEPER_CPU_DECODE_WEIGHTS=off` keeps one copy, and a misspelt value
stops a server's start with one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import cpu_ext, cpu_linear

needs_avx512 = pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
    reason="the few-row product is offered on AVX-512 hosts only (kernels/cpu_linear.py)",
)


@pytest.fixture(autouse=True)
def _built() -> None:
    """scripts/setup.sh --test builds the extension: here it must load, not be skipped."""
    assert cpu_ext.unavailable_reason() is None


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return (out if bias is None else out + bias.double()).float()


def test_pack_lays_out_panels_of_32_features_with_zeros_past_n() -> None:
    w = torch.randn(70, 9)
    panels = cpu_linear.pack(w)
    assert panels.shape == (3, 9, 32) and panels.is_contiguous()
    unpacked = panels.transpose(1, 2).reshape(96, 9)
    assert torch.equal(unpacked[:70], w) and not unpacked[70:].any()


@pytest.mark.parametrize("n,k", [(1536, 512), (100, 300), (33, 1408), (32, 7)])
@pytest.mark.parametrize("rows", [1, 3, 12, 13, 25])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_product_matches_a_float64_reference(n: int, k: int, rows: int, with_bias: bool) -> None:
    torch.manual_seed(n + k + rows)
    w, x = torch.randn(n, k) * 0.05, torch.randn(rows, k)
    bias = torch.randn(n) if with_bias else None
    got = cpu_linear.linear(x, cpu_linear.pack(w), n, bias)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(x, w, bias), rtol=1e-5, atol=2e-5)


def test_strided_rows_and_leading_dimensions() -> None:
    """x as a view whose rows are strided (a slice of a wider activation) and with leading dimensions."""
    torch.manual_seed(1)
    w = torch.randn(64, 96)
    wide = torch.randn(2, 5, 200)
    x = wide[..., 10:106]  # [2, 5, 96], row stride 200
    got = cpu_linear.linear(x, cpu_linear.pack(w), 64)
    assert got.shape == (2, 5, 64)
    torch.testing.assert_close(got, _reference(x.reshape(-1, 96), w, None).view(2, 5, 64), rtol=1e-5, atol=2e-5)


def test_each_rows_numbers_do_not_depend_on_the_other_rows_or_the_threads() -> None:
    """Bit for bit: a row alone, among 5, 12, 13 or 30 rows, and on one thread or two."""
    torch.manual_seed(2)
    n, k = 300, 1100  # three k blocks of 512 and a panel cut short
    w, x = torch.randn(n, k) * 0.05, torch.randn(30, k)
    panels = cpu_linear.pack(w)
    everything = cpu_linear.linear(x, panels, n)
    for rows in (1, 5, 12, 13):
        assert torch.equal(cpu_linear.linear(x[:rows], panels, n), everything[:rows]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_linear.linear(x, panels, n), everything)
    finally:
        torch.set_num_threads(threads)


def test_operands_it_cannot_take_are_refused_with_what_is_wrong() -> None:
    w = torch.randn(40, 16)
    panels = cpu_linear.pack(w)
    with pytest.raises(RuntimeError, match="x must be float32"):
        cpu_linear.linear(torch.randn(2, 16, dtype=torch.float64), panels, 40)
    with pytest.raises(RuntimeError, match=r"packed must be contiguous float32 \[ceil\(N / 32\), K, 32\]"):
        cpu_linear.linear(torch.randn(2, 17), panels, 40)
    with pytest.raises(RuntimeError, match="bias must be contiguous float32"):
        cpu_linear.linear(torch.randn(2, 16), panels, 40, torch.randn(41))
    assert cpu_linear.linear(torch.randn(0, 16), panels, 40).shape == (0, 40)


def test_the_mode_is_checked(monkeypatch) -> None:
    monkeypatch.setenv(cpu_linear.ENV, "sometimes")
    with pytest.raises(ValueError, match="PAGEKEEPER_CPU_DECODE_WEIGHTS='sometimes' is not one of auto, off"):
        cpu_linear.mode()
    monkeypatch.setenv(cpu_linear.ENV, "off")
    assert not cpu_linear.available()


# ---- in the CPU's linear layers ---------------------------------------------------------------------------------


class _Layers(torch.nn.Module):
    """A merged projection with a bias, a row-parallel one with K above one k block, and an untied head."""

    def __init__(self) -> None:
        from engine.model.layers.linear import MergedLinear, RowLinear, VocabEmbedding
        from engine.parallel.group import SINGLE

        super().__init__()
        self.embed_tokens = VocabEmbedding(300, 64)
        self.up = MergedLinear(64, {"a": 600, "b": 100}, bias=True)
        self.down = RowLinear(700, 64, bias=False, tp=SINGLE)
        self.lm_head = VocabEmbedding(300, 64)

    def run(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(self.down(self.up(self.embed_tokens(ids))))


def _layers() -> _Layers:
    torch.manual_seed(0)
    model = _Layers()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return model


@needs_avx512
def test_few_rows_take_the_panel_copy_and_more_rows_onednns_product(monkeypatch) -> None:
    from engine.model import cpu_packing

    model = _layers()
    ids = torch.randint(0, 300, (40,))
    with torch.no_grad():
        plain = model.run(ids)
        assert cpu_packing.pack_linears(model) == 3
        assert model.up.forward.panels is not None and model.up.forward.few_rows == cpu_packing.FEW_ROWS
        assert model.lm_head.logits.product.few_rows == cpu_packing.HEAD_FEW_ROWS
        # the copies: up 704 x 64 (700 rounded up to 32-wide panels), down 64 x 700, head 320 x 64, float32
        assert cpu_packing.panel_bytes(model) == 4 * (704 * 64 + 64 * 700 + 320 * 64)
        calls = {"panels": 0}
        real = cpu_linear.linear

        def counted(*args, **kwargs):
            calls["panels"] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(cpu_linear, "linear", counted)
        many = model.run(ids)  # 40 rows: oneDNN's product in every layer
        assert calls["panels"] == 0
        few = torch.cat([model.run(ids[i : i + 4]) for i in range(0, 40, 4)])  # 4 rows: the copies, head too
        assert calls["panels"] == 30
    torch.testing.assert_close(many, plain, rtol=1e-5, atol=1e-5)
    # the two products order their sums differently once K is above one block (down's 700): float32 rounding apart
    torch.testing.assert_close(few, many, rtol=1e-5, atol=1e-5)


@needs_avx512
def test_off_keeps_one_copy(monkeypatch) -> None:
    from engine.model import cpu_packing

    monkeypatch.setenv(cpu_linear.ENV, "off")
    model = _layers()
    assert cpu_packing.pack_linears(model) == 3
    assert model.up.forward.panels is None and cpu_packing.panel_bytes(model) == 0


def test_a_misspelt_mode_stops_a_servers_start_with_one_line() -> None:
    from tests.server.harness import REPO, free_port

    env = {**os.environ, cpu_linear.ENV: "sometimes"}
    r = subprocess.run(
        [sys.executable, "-m", "engine.server", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, cwd=str(REPO), env=env,
    )  # fmt: skip
    last = r.stderr.strip().splitlines()[-1]
    print(last)
    assert r.returncode == 2 and "PAGEKEEPER_CPU_DECODE_WEIGHTS='sometimes' is not one of auto, off" in last


@needs_avx512
def test_a_row_parallel_layer_sums_its_ranks_over_the_panel_copy() -> None:
    """On a tensor-parallel rank the partial product takes the copy, and the layer's forward still sums over the
    ranks and adds the bias once."""
    import torch.nn.functional as F

    from engine.model import cpu_packing
    from engine.model.layers.linear import RowLinear
    from tests.engine.test_tp_overlap import TwinRanks

    torch.manual_seed(3)
    layer = RowLinear(700, 40, bias=True, tp=TwinRanks(0, 2))
    torch.nn.init.normal_(layer.weight, std=0.1)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 350)  # this rank's half of K
    with torch.no_grad():
        want = 2 * F.linear(x, layer.weight) + layer.bias
        assert cpu_packing.pack_linears(layer) == 1
        assert layer.partial.panels is not None and "forward" not in vars(layer)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
