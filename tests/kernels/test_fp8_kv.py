"""FP8 KV cache kernels: the e4m3 encoder, the cache write, block moves, and decode/prefill attention
reading fp8 blocks, each against kernels/reference.py (Triton's CPU interpreter without a GPU).

The attention oracle is the float64 attention over the *dequantized* cache (stored x scale): what
an fp8 kernel must compute exactly, up to its query dtype's rounding.  How far that is from the
unquantized cache is a property of the format, measured in tests/engine/test_fp8_kv_cache.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import cache_ops, cpu_backend, reference, triton_backend  # noqa: E402
from kernels import paged_attention as pa  # noqa: E402
from kernels.fp8 import e4m3_bits  # noqa: E402
from tests.kernels.paged_cases import TOLERANCE, make_case, reference_fp64, rel_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


@triton.jit
def _encode_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, e4m3_bits(tl.load(x_ptr + offs).to(tl.float32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_encoder_rounds_exactly_as_torch(dtype):
    """Round to nearest even, carries into the exponent, subnormals, saturation at 448, signed zeros."""
    n = 8192
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(n, generator=g, device=DEVICE) * torch.logspace(-5, 3, n, device=DEVICE)
    x[:6] = torch.tensor([0.0, -0.0, 448.0, 1000.0, -1e6, 0.0305], device=DEVICE)
    x = x.to(dtype)
    out = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    _encode_kernel[(1,)](x, out, N=n)
    want = x.float().clamp(-448, 448).to(FP8).view(torch.uint8)
    mismatches = int((out != want).sum())
    print(f"e4m3 encoder, {n} {dtype} values: {mismatches} differ from torch")
    assert mismatches == 0


def _scales(num_kv_heads: int, seed: int) -> torch.Tensor:
    """Powers of two from 1/8 to 4, different per head and for K and V."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.randint(-3, 3, (2, num_kv_heads), generator=g).float()).to(DEVICE)


def _quantized(case, kv_scale: torch.Tensor):
    """The case with its cache stored as fp8, and the oracle's case over the dequantized cache."""
    s = kv_scale[:, None, :, None, None]
    fp8 = reference.quantize_fp8(case.kv_cache, s)
    dequant = dataclasses.replace(case, kv_cache=(fp8.float() * s).to(torch.float64))
    return dataclasses.replace(case, kv_cache=fp8), dequant


def _check(out, dequant_case, dtype, what):
    err = rel_error(out, reference_fp64(dequant_case))
    print(f"ERR fp8 {what} {str(dtype).removeprefix('torch.')} {err:.3e}")
    assert err <= TOLERANCE[dtype], f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_is_byte_identical_to_the_reference(dtype):
    g = torch.Generator(device=DEVICE).manual_seed(2)
    pool, bs, heads, d = 7, 16, 2, 80
    cache = torch.randn(2, pool, heads, bs, d, generator=g, device=DEVICE).to(FP8)  # garbage in unwritten slots
    slots = torch.randperm(pool * bs, generator=g, device=DEVICE)[:20]
    slots[[3, 11]] = -1
    qkv = (torch.randn(20, 4 + 2 * heads, d, generator=g, device=DEVICE) * 40).to(dtype)  # some saturate
    key, value = qkv[:, 4 : 4 + heads], qkv[:, 4 + heads :]
    kv_scale = _scales(heads, 3)
    expected = cache.clone()
    reference.write_kv(key, value, expected, slots, kv_scale)
    cache_ops.write_kv(key, value, cache, slots, kv_scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    back = expected.float()[0][slots[0] // bs, :, slots[0] % bs] * kv_scale[0][:, None]
    rel = ((back - key[0].float()).abs() / key[0].float().abs().clamp(min=1e-3)).max()
    print(f"fp8 write: byte-identical; read back within {rel:.3f} relative (e4m3: <= 1/16 unless saturated)")


def test_reference_round_trip_error_is_half_an_e4m3_step():
    x = torch.randn(4096, 8, 64) * 3
    scale = torch.tensor([0.25, 0.5, 1, 2, 0.125, 1, 4, 0.5])[None, :, None]
    back = reference.quantize_fp8(x, scale).float() * scale
    normal = (x.abs() / scale) >= 2**-6
    rel = ((back - x).abs() / x.abs())[normal].max()
    print(f"fp8 round trip: max relative error {rel:.4f} in the normal range (bound 2^-4 = 0.0625)")
    assert rel <= 2**-4 + 1e-7


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_reads_fp8_blocks(block_size, dtype):
    lens = [1, 17, 40, 123, 300]
    case = make_case(
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        block_size=block_size,
        q_lens=[1] * len(lens),
        seq_lens=lens,
        dtype=dtype,
        device=DEVICE,
        seed=block_size,
    )
    kv_scale = _scales(2, block_size)
    fp8, dequant = _quantized(case, kv_scale)
    for splits in (1, 3):
        out = torch.full_like(case.query, float("nan"))
        pa.paged_attention_decode(
            fp8.query,
            fp8.kv_cache,
            fp8.block_tables,
            fp8.seq_lens,
            fp8.scale,
            fp8.max_seq_len,
            out=out,
            num_splits=splits,
            kv_scale=kv_scale,
        )
        _check(out, dequant, dtype, f"decode bs={block_size} splits={splits}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_and_mixed_steps_read_fp8_blocks(dtype):
    q_lens, lens = [1, 1, 5, 13, 70], [40, 9, 5, 30, 90]
    case = make_case(
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        q_lens=q_lens,
        seq_lens=lens,
        dtype=dtype,
        device=DEVICE,
        seed=11,
    )
    kv_scale = _scales(2, 5)
    fp8, dequant = _quantized(case, kv_scale)
    for num_decodes in (0, 2):  # the prefill kernel for every row; decode + prefill kernels in one step
        out = torch.full_like(case.query, float("nan"))
        triton_backend.paged_attention(*fp8.args(), out=out, num_decodes=num_decodes, kv_scale=kv_scale)
        _check(out, dequant, dtype, f"prefill num_decodes={num_decodes}")


def _nhd(cache: torch.Tensor) -> torch.Tensor:
    """The same cache in kernels.cpu_backend's token-major layout [2, blocks, block_size, heads, dim]."""
    return cache.view(torch.uint8).permute(0, 1, 3, 2, 4).contiguous().view(cache.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_paths_read_fp8_blocks(dtype):
    """kernels.reference and kernels.cpu_backend (token-major layout: the same bytes, permuted) on an fp8
    cache: decode, and a mixed step (a decode row, then prefill chunks)."""
    for q_lens, lens in (([1, 1, 1], [3, 70, 200]), ([1, 4, 9], [33, 20, 9])):
        case = make_case(
            num_heads=8,
            num_kv_heads=2,
            head_dim=16,
            block_size=8,
            q_lens=q_lens,
            seq_lens=lens,
            dtype=dtype,
            device="cpu",
            seed=sum(lens),
        )
        kv_scale = _scales(2, 7).cpu()
        fp8, dequant = _quantized(case, kv_scale)
        num_decodes = 1 if q_lens[1] > 1 else 0
        out = reference.paged_attention(*fp8.args(), num_decodes=num_decodes, kv_scale=kv_scale)
        _check(out, dequant, dtype, f"reference q={q_lens}")
        args = list(fp8.args())
        args[1] = _nhd(fp8.kv_cache)
        out = cpu_backend.paged_attention(*args, num_decodes=num_decodes, kv_scale=kv_scale)
        _check(out, dequant, dtype, f"cpu_backend q={q_lens}")
    with pytest.raises(ValueError, match="needs kv_scale"):
        reference.paged_attention(*fp8.args())
    with pytest.raises(ValueError, match="needs kv_scale"):
        cpu_backend.paged_attention(*args)


def test_cpu_backend_writes_the_references_bytes():
    """The CPU backend's fp8 write (token-major) stores the same bytes as the reference's (head-major)."""
    g = torch.Generator().manual_seed(4)
    pool, bs, heads, d = 6, 8, 2, 16
    ref = torch.randn(2, pool, heads, bs, d, generator=g).to(FP8)
    mine = _nhd(ref)
    slots = torch.randperm(pool * bs, generator=g)[:17]
    slots[5] = -1
    key, value = (torch.randn(17, heads, d, generator=g) * 20 for _ in range(2))
    kv_scale = _scales(heads, 9).cpu()
    reference.write_kv(key, value, ref, slots, kv_scale)
    cpu_backend.write_kv(key, value, mine, slots, kv_scale)
    assert torch.equal(mine.view(torch.uint8), _nhd(ref).view(torch.uint8))


def test_block_moves_copy_fp8_bytes():
    """Copy-on-write, swap-out gather and swap-in scatter move an fp8 cache's bytes unchanged."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    cache = torch.randn(2, 12, 2, 16, 32, generator=g, device=DEVICE).to(FP8)
    src, dst = torch.tensor([5, 0, 7], device=DEVICE), torch.tensor([2, 9, 11], device=DEVICE)
    expected = cache.clone()
    reference.copy_blocks(expected, src, dst)
    cache_ops.copy_blocks(cache, src, dst)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    ids = torch.tensor([11, 3, 4], device=DEVICE)
    host = cache_ops.gather_blocks(cache, ids).cpu()
    assert host.dtype == FP8 and torch.equal(host.view(torch.uint8), cache[:, ids].cpu().view(torch.uint8))
    cache_ops.scatter_blocks(cache, host.to(DEVICE), torch.tensor([0, 1, 6], device=DEVICE))
    assert torch.equal(cache[:, [0, 1, 6]].view(torch.uint8), cache[:, ids].view(torch.uint8))


# -- real sizes on the GPU ------------------------------------------------------------------------

LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_gpu_fp8_kernels_llama3_sizes(block_size):
    """Decode at batch 64 (ragged up to 4,096) and a few long sequences (split-K), prefill chunks of 2,048,
    in bfloat16 and float16, against the float64 oracle over the dequantized cache; the write at 8,192 tokens
    byte-identical to the reference."""
    g = torch.Generator().manual_seed(block_size)
    for dtype in (torch.bfloat16, torch.float16):
        for q_lens, lens in (
            ([1] * 64, torch.randint(1, 4097, (64,), generator=g).tolist()),
            ([1] * 3, [3000, 8192, 5000]),
            ([2048, 2048, 777, 1], [2048, 3548, 1234, 4000]),
        ):
            case = make_case(
                **LLAMA3_8B, block_size=block_size, q_lens=q_lens, seq_lens=lens, dtype=dtype, device="cuda", seed=1
            )
            kv_scale = _scales(8, block_size)
            fp8, dequant = _quantized(case, kv_scale)
            out = torch.full_like(case.query, float("nan"))
            # a mixed step lists its one-token sequences first; here the decode comes last, so none lead
            leading = next((i for i, q in enumerate(q_lens) if q > 1), len(q_lens))
            triton_backend.paged_attention(*fp8.args(), out=out, kv_scale=kv_scale, num_decodes=leading)
            _check(out, dequant, dtype, f"gpu bs={block_size} q={q_lens[:2]}")
    cache = torch.randn(2, 4096, 8, block_size, 128, device="cuda").to(FP8)
    slots = torch.randperm(4096 * block_size, device="cuda")[:8192]
    slots[::7] = -1
    qkv = (torch.randn(8192, 48, 128, device="cuda") * 30).to(torch.bfloat16)
    kv_scale = _scales(8, 0)
    expected = cache.clone()
    reference.write_kv(qkv[:, 32:40], qkv[:, 40:], expected, slots, kv_scale)
    cache_ops.write_kv(qkv[:, 32:40], qkv[:, 40:], cache, slots, kv_scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
