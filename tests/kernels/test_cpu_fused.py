"""The compiled CPU operations (kernels/csrc/cpu_fused.cpp through kernels/cpu_fused.py) against the torch reference
they replace: RMSNorm with and without the residual add, SiLU-and-multiply, rotary in place on views of a fused QKV
output, and the KV write with padding slots. float32, bfloat16 and float16; one row (a decode step of one sequence)
and enough rows for the threads to split them. bf16/fp16 results are the reference's bit for bit except where the
RMS's float32 sum is ordered differently or SiLU's exp is an ulp off near a rounding tie (a few elements in ten
thousand, a rounding step or two); float32 within a few ulps. Also: the fallback to the reference where the
extension is not loaded or an operand is not one the compiled code takes."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_backend, cpu_ext, cpu_fused, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 3, 257]  # one decode row; a few; more than one thread's share (the grain is 32k elements)


@pytest.fixture(autouse=True)
def _built() -> None:
    """scripts/setup.sh --test builds the extension: here it must load, not be skipped."""
    assert cpu_ext.unavailable_reason() is None


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        return
    # On a small fraction of the elements only, and by a few rounding steps of the dtype at most: an intermediate
    # that lands one step apart (the RMS, or SiLU's exp, one float32 ulp off the reference's near a rounding tie)
    # is then multiplied by the weight or `up`, whose own rounding can add a second step.
    step = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= 4 * step * want.float().abs().clamp_min(1e-3)).all()), float(diff.max())
    assert float((got != want).float().mean()) < 0.01


def test_the_cpu_backend_is_the_compiled_module() -> None:
    assert kernels.fused_backend("cpu") is cpu_fused


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_the_residual(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    residual = torch.randn(rows, 576, generator=g).to(dtype)
    weight = (torch.rand(576, generator=g) + 0.5).to(dtype)
    got, none = cpu_fused.rms_norm(x, weight, 1e-6)
    want, _ = reference.rms_norm(x, weight, 1e-6)
    assert none is None
    _close(got, want, dtype)
    got, got_sum = cpu_fused.rms_norm(x, weight, 1e-5, residual)
    want, want_sum = reference.rms_norm(x, weight, 1e-5, residual)
    assert got_sum is not None and want_sum is not None
    assert torch.equal(got_sum, want_sum)  # the residual add rounds exactly as the reference's
    _close(got, want, dtype)


def test_rms_norm_of_a_strided_three_dimensional_input() -> None:
    """qk-norm (Qwen3) normalizes each head of q, a strided view of the QKV output."""
    qkv = torch.randn(5, 12 * 64)
    q = qkv[:, : 8 * 64].reshape(5, 8, 64)
    weight = torch.rand(64) + 0.5
    got, _ = cpu_fused.rms_norm(q, weight, 1e-6)
    want, _ = reference.rms_norm(q, weight, 1e-6)
    assert got.shape == (5, 8, 64)
    _close(got, want, torch.float32)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1408, generator=g) * 4).to(dtype)
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 30.0, -30.0, 90.0, -100.0])  # the exp's clamp and both signs
    _close(cpu_fused.silu_mul(gate_up), reference.silu_mul(gate_up), dtype)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_views_of_the_qkv_output(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    heads, kv_heads, dim = 8, 2, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    before = qkv.clone()
    q = qkv[:, : heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    positions = torch.randint(0, 512, (rows,), generator=g)
    freqs = torch.outer(torch.arange(512).float(), 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = freqs.cos(), freqs.sin()
    want_q, want_k = reference.rotary(q.clone(), k.clone(), positions, cos, sin)
    got_q, got_k = cpu_fused.rotary(q, k, positions, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # every product rounded as the reference's
    v_start = (heads + kv_heads) * dim
    assert torch.equal(qkv[:, v_start:], before[:, v_start:])  # v untouched


def test_rotary_refuses_a_position_outside_its_tables() -> None:
    q, k = torch.randn(2, 4, 64), torch.randn(2, 4, 64)
    table = torch.randn(16, 32)
    with pytest.raises(RuntimeError, match="outside the cos/sin tables"):
        cpu_fused.rotary(q, k, torch.tensor([3, 16]), table, table)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_the_torch_path(dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    tokens, kv_heads, dim, blocks, block_size = 37, 2, 64, 9, 8
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * dim, generator=g).to(dtype)
    k = qkv[:, 4 * dim : (4 + kv_heads) * dim].view(tokens, kv_heads, dim)  # strided rows, as the model's
    v = qkv[:, (4 + kv_heads) * dim :].view(tokens, kv_heads, dim)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens].to(slot_dtype)
    slots[[0, 5, 36]] = -1  # padding: not written
    cache = torch.randn(2, blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    want = cache.clone()
    valid = slots >= 0
    flat = want.view(2, blocks * block_size, kv_heads, dim)
    flat[0, slots[valid].long()] = k[valid]
    flat[1, slots[valid].long()] = v[valid]
    assert cpu_fused.write_kv(k, v, cache, slots)
    assert torch.equal(cache, want)
    again = want.clone()
    cpu_backend.write_kv(k, v, again, slots)  # the backend takes the compiled copy too
    assert torch.equal(again, want)


def test_write_kv_leaves_other_dtypes_to_the_torch_path() -> None:
    cache = torch.zeros(2, 2, 4, 1, 8, dtype=torch.bfloat16)
    k = torch.randn(3, 1, 8)  # float32 into a bf16 cache: a cast the compiled copy does not do
    assert not cpu_fused.write_kv(k, k, cache, torch.tensor([0, 1, 2]))
    assert not bool(cache.any())
    cpu_backend.write_kv(k, k, cache, torch.tensor([0, 1, 2]))
    assert torch.equal(cache[0].view(-1, 1, 8)[:3], k.to(torch.bfloat16))


def test_without_the_extension_the_reference_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_ext, "available", lambda: False)
    x = torch.randn(3, 64)
    weight = torch.rand(64)
    monkeypatch.setattr(torch.ops.pagekeeper_cpu, "rms_norm", None, raising=False)  # any call would fail
    got, _ = cpu_fused.rms_norm(x, weight, 1e-6)
    assert torch.equal(got, reference.rms_norm(x, weight, 1e-6)[0])
    assert not cpu_fused.handles_rotary(x.view(3, 1, 64), x.view(3, 1, 64), torch.rand(4, 32), torch.rand(4, 32))
    cache = torch.zeros(2, 1, 4, 1, 64)
    assert not cpu_fused.write_kv(x.view(3, 1, 64), x.view(3, 1, 64), cache, torch.tensor([0, 1, 2]))


def test_a_weight_in_another_dtype_takes_the_reference() -> None:
    """The reference promotes (a float32 weight over bf16 activations gives float32); the compiled norm would not."""
    x = torch.randn(2, 64).to(torch.bfloat16)
    weight = torch.rand(64)
    got, _ = cpu_fused.rms_norm(x, weight, 1e-6)
    want, _ = reference.rms_norm(x, weight, 1e-6)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)


def test_rotary_takes_int32_and_strided_positions() -> None:
    """The runner's positions may come as int32 or as a view; the compiled rotary gets them as contiguous int64."""
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    table = torch.randn(32, 32)
    positions = torch.tensor([[5, 0], [7, 0], [9, 0]], dtype=torch.int32)[:, 0]
    want_q, want_k = reference.rotary(q.clone(), k.clone(), positions.long(), table, table)
    got_q, got_k = cpu_fused.rotary(q, k, positions, table, table)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
