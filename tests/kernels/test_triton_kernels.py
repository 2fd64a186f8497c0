"""The Triton kernels against the float64 oracle and kernels/reference.py.

Without a GPU these run in Triton's CPU interpreter (tests/kernels/conftest.py sets
TRITON_INTERPRET=1) at small sizes; the `gpu` tests at the bottom run the same checks at real
sizes on a CUDA device.  Every run draws fresh random inputs (never zeros), uses ragged lengths that
are not multiples of the block size and shuffled block tables, and poisons the output with NaN
first so that an element the kernel did not write fails.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import attention_backend, cache_ops, reference, triton_backend  # noqa: E402
from kernels import paged_attention as pa  # noqa: E402
from tests.kernels.paged_cases import TOLERANCE, make_case, reference_fp64, rel_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GQA = [(4, 4), (8, 2), (8, 1)]  # ratios 1, 4, 8
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZES = [8, 16, 32]
HEAD_DIMS = [16, 64, 80, 96, 128]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layouts() -> list:
    """(dtype, block_size, num_heads, num_kv_heads) for the decode and prefill grids.  On a GPU: every combination.
    In the CPU interpreter (1-4 s a case; the grids took 110 s of the suite): every block size and grouping in
    float32, and each half-precision dtype on the diagonal, so that it still meets every block size and every
    grouping once.  A dtype's casts and accumulation do not depend on the block size or the grouping, which only
    change the indexing that the float32 grid covers in full."""
    return [
        pytest.param(dtype, bs, h, kv, id=f"{_name(dtype)}-bs{bs}-{h}q{kv}kv")
        for dtype in DTYPES
        for bs in BLOCK_SIZES
        for h, kv in GQA
        if DEVICE == "cuda" or dtype == torch.float32 or BLOCK_SIZES.index(bs) == GQA.index((h, kv))
    ]


def _head_dims() -> list:
    """Every head size in float32; in the CPU interpreter the half-precision dtypes take the two that are not
    powers of two (80, 96: the masked, padded tail of the head dimension), the rest on a GPU."""
    return [
        pytest.param(dtype, d, id=f"{_name(dtype)}-d{d}")
        for dtype in DTYPES
        for d in HEAD_DIMS
        if dtype == torch.float32 or DEVICE == "cuda" or d in (80, 96)
    ]


@pytest.fixture(autouse=True)
def poisoned_scratch(monkeypatch):
    """The split-K scratch the decode path allocates, filled with NaN so that a partial result the
    kernel did not write would show in the output.  Yields the shapes allocated (the split tests check
    that the poisoned allocation was really used)."""
    shapes = []
    allocate = pa._scratch

    def poisoned(shape, device):
        shapes.append(tuple(shape))
        return allocate(shape, device).fill_(float("nan"))

    monkeypatch.setattr(pa, "_scratch", poisoned)
    return shapes


def _poisoned(case):
    return torch.full_like(case.query, float("nan"))


def _check(out, case, what=""):
    err = rel_error(out, reference_fp64(case))
    tol = TOLERANCE[case.query.dtype]
    print(f"ERR {what} {str(case.query.dtype).removeprefix('torch.')} {err:.3e}")
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"
    return err


# -- decode ---------------------------------------------------------------------------------------

DECODE_LENS = [1, 17, 40, 123, 300]  # 1 token, < block, not multiples of any block size, several splits


@pytest.mark.parametrize("dtype,block_size,num_heads,num_kv_heads", _layouts())
def test_decode(block_size, num_heads, num_kv_heads, dtype, poisoned_scratch):
    seed = hash((block_size, num_heads, num_kv_heads, str(dtype))) % 2**31
    case = make_case(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=block_size,
        q_lens=[1] * len(DECODE_LENS),
        seq_lens=DECODE_LENS,
        dtype=dtype,
        device=DEVICE,
        seed=seed,
    )
    for splits in (None, 1, 3):  # the heuristic, one program per sequence, split-K (flash decoding)
        poisoned_scratch.clear()
        out = _poisoned(case)
        pa.paged_attention_decode(
            case.query,
            case.kv_cache,
            case.block_tables,
            case.seq_lens,
            case.scale,
            case.max_seq_len,
            out=out,
            num_splits=splits,
        )
        _check(out, case, f"decode splits={splits}")
        if splits == 3:  # the partials came from the NaN-poisoned scratch: [B, Hq, splits, D_pad] and [B, Hq, splits]
            assert [shape[:3] for shape in poisoned_scratch] == [(len(DECODE_LENS), num_heads, 3)] * 2


def test_one_tile_splits_fill_the_gpu_for_a_few_short_contexts():
    # a split may be one tile long: one sequence of 8 KV heads in a 1,024-token graph takes 16 splits of 64 tokens
    # on a 132-SM GPU (4 SMs in the interpreter: 8 programs for 2 waves)
    assert pa.MIN_TOKENS_PER_SPLIT == pa.decode_config(128, 16, torch.bfloat16)["BLOCK_N"]
    assert pa.num_decode_splits(1, 1, 1024, torch.device("cpu")) == 8
    assert pa.num_decode_splits(1, 1, 256, torch.device("cpu")) == 256 // pa.MIN_TOKENS_PER_SPLIT


def test_long_contexts_are_split_whatever_the_batch():
    # a full batch of short contexts stays one program per (sequence, KV head)
    assert pa.num_decode_splits(256, 8, 768, torch.device("cpu")) == 1
    # contexts that may reach 3,072 tokens are split into ~512-token pieces even when the batch fills the GPU:
    # its long-tailed sequences would otherwise hold the step (benchmarks/decode_long_tailed.py)
    assert pa.num_decode_splits(256, 8, 3072, torch.device("cpu")) == 6
    assert pa.num_decode_splits(80, 8, 3072, torch.device("cpu")) == 6
    # a small batch keeps the split that fills the GPU when that is more
    assert pa.num_decode_splits(1, 8, 8192, torch.device("cpu")) >= 8192 // pa.LONG_CONTEXT_SPLIT_TOKENS
    assert pa.num_decode_splits(64, 8, 200_000, torch.device("cpu")) == pa.MAX_SPLITS


def test_decode_of_long_tailed_contexts_with_the_chosen_splits():
    # one long context among short ones, as a serving batch: the heuristic's split (3 pieces of the 1,600-token
    # maximum) leaves the short sequences' later splits empty, and the combine must skip them
    lens = [3, 40, 1600, 17, 520]
    case = make_case(
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        q_lens=[1] * len(lens),
        seq_lens=lens,
        dtype=torch.float32,
        device=DEVICE,
        seed=7,
    )
    assert pa.num_decode_splits(len(lens), 2, case.max_seq_len, torch.device(DEVICE)) == 3
    out = _poisoned(case)
    triton_backend.paged_attention(*case.args(), out=out)
    _check(out, case, "decode long-tailed")


@pytest.mark.parametrize("dtype,head_dim", _head_dims())
def test_decode_head_dims(head_dim, dtype):
    case = make_case(
        num_heads=8,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=16,
        q_lens=[1, 1, 1],
        seq_lens=[5, 70, 200],
        dtype=dtype,
        device=DEVICE,
        seed=head_dim,
    )
    for splits in (1, 2):
        out = _poisoned(case)
        pa.paged_attention_decode(
            case.query,
            case.kv_cache,
            case.block_tables,
            case.seq_lens,
            case.scale,
            case.max_seq_len,
            out=out,
            num_splits=splits,
        )
        _check(out, case, f"decode d={head_dim} splits={splits}")


# -- prefill / extend -----------------------------------------------------------------------------

# A fresh prompt, an extend over cached context (chunked prefill / prefix hit), a decode row mixed in,
# and a chunk longer than one tile of query rows, all in one launch.
PREFILL_Q = [5, 13, 1, 70]
PREFILL_L = [5, 30, 9, 90]


@pytest.mark.parametrize("dtype,block_size,num_heads,num_kv_heads", _layouts())
def test_prefill(block_size, num_heads, num_kv_heads, dtype):
    seed = hash(("p", block_size, num_heads, num_kv_heads, str(dtype))) % 2**31
    case = make_case(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=block_size,
        q_lens=PREFILL_Q,
        seq_lens=PREFILL_L,
        dtype=dtype,
        device=DEVICE,
        seed=seed,
    )
    out = _poisoned(case)
    triton_backend.paged_attention(*case.args(), out=out)
    _check(out, case, "prefill")


@pytest.mark.parametrize("dtype,head_dim", _head_dims())
def test_prefill_head_dims(head_dim, dtype):
    case = make_case(
        num_heads=4,
        num_kv_heads=1,
        head_dim=head_dim,
        block_size=16,
        q_lens=[3, 40],
        seq_lens=[50, 40],
        dtype=dtype,
        device=DEVICE,
        seed=head_dim,
    )
    out = _poisoned(case)
    pa.paged_attention_prefill(*case.args()[:7], out=out)
    _check(out, case, f"prefill d={head_dim}")


def test_prefill_spans_several_query_tiles():
    """Query chunks longer than BLOCK_M (fp32 tiles are 64 rows) over a long cached prefix."""
    case = make_case(
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=16,
        q_lens=[150, 64, 1],
        seq_lens=[333, 64, 77],
        dtype=torch.float32,
        device=DEVICE,
        seed=7,
    )
    out = _poisoned(case)
    triton_backend.paged_attention(*case.args(), out=out)
    _check(out, case, "prefill tiles")


def test_backend_matches_reference_module():
    """The backend's entry point, both dispatch paths, against kernels/reference.py itself."""
    for q_lens, lens in (([1, 1, 1], [3, 33, 64]), ([4, 1, 9], [20, 33, 9])):
        case = make_case(
            num_heads=8,
            num_kv_heads=2,
            head_dim=16,
            block_size=8,
            q_lens=q_lens,
            seq_lens=lens,
            dtype=torch.float32,
            device=DEVICE,
            seed=sum(lens),
        )
        ref = reference.paged_attention(*case.args())
        out = triton_backend.paged_attention(*case.args())
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_attention_backend_picks_triton_on_cuda_only():
    assert attention_backend("cuda") is triton_backend
    assert attention_backend(torch.device("cuda", 0)) is triton_backend
    from kernels import cpu_backend

    assert attention_backend("cpu") is cpu_backend  # the reference's interface, with a faster decode path


# -- cache ops ------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv(block_size, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(block_size)
    num_kv_heads, head_dim, num_heads, pool = 2, 80, 8, 9
    cache = torch.randn(2, pool, num_kv_heads, block_size, head_dim, generator=g, device=DEVICE).to(dtype)
    slots = torch.randperm(pool * block_size, generator=g, device=DEVICE)[:20]
    slots[[3, 11]] = -1  # padding: not written
    # K and V as the model produces them: views into one fused qkv projection (non-contiguous rows),
    # in the cache's dtype; and in float32, which the kernel converts (round to nearest even).  The
    # interpreter truncates float32 -> bfloat16 instead, so that conversion is checked on the GPU only.
    kv_dtypes = [dtype] + (
        [torch.float32] if dtype != torch.float32 and (DEVICE == "cuda" or dtype == torch.float16) else []
    )
    for kv_dtype in kv_dtypes:
        qkv = torch.randn(20, num_heads + 2 * num_kv_heads, head_dim, generator=g, device=DEVICE).to(kv_dtype)
        key, value = qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
        expected = cache.clone()
        reference.write_kv(key, value, expected, slots)
        cache_ops.write_kv(key, value, cache, slots.to(torch.int64))
        assert torch.equal(cache, expected)  # untouched slots (random garbage) included


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_gather_scatter_blocks(dtype):
    g = torch.Generator(device=DEVICE).manual_seed(3)
    cache = torch.randn(2, 12, 2, 16, 80, generator=g, device=DEVICE).to(dtype)
    src, dst = torch.tensor([5, 0, 7], device=DEVICE), torch.tensor([2, 9, 11], device=DEVICE)
    expected = cache.clone()
    reference.copy_blocks(expected, src, dst)
    cache_ops.copy_blocks(cache, src, dst)
    assert torch.equal(cache, expected)

    ids = torch.tensor([11, 3, 4, 0], dtype=torch.int32, device=DEVICE)
    buf = torch.full((2, 4, 2, 16, 80), float("nan"), device=DEVICE).to(dtype)
    cache_ops.gather_blocks(cache, ids, out=buf)
    assert torch.equal(buf, reference.gather_blocks(cache, ids))

    new = torch.randn(2, 4, 2, 16, 80, generator=g, device=DEVICE).to(dtype)
    expected = cache.clone()
    reference.scatter_blocks(expected, new, ids)
    cache_ops.scatter_blocks(cache, new, ids)
    assert torch.equal(cache, expected)


def test_swap_round_trip_through_cpu():
    """gather -> CPU -> scatter into other blocks restores the data exactly (swap out, swap in)."""
    g = torch.Generator(device=DEVICE).manual_seed(4)
    cache = torch.randn(2, 10, 2, 8, 16, generator=g, device=DEVICE)
    out_ids, in_ids = torch.tensor([1, 6, 2], device=DEVICE), torch.tensor([9, 0, 4], device=DEVICE)
    host = triton_backend.gather_blocks(cache, out_ids).cpu()
    triton_backend.scatter_blocks(cache, host.to(DEVICE), in_ids)
    assert torch.equal(cache[:, in_ids], cache[:, out_ids])


# -- real sizes on the GPU ------------------------------------------------------------------------

LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)


def _ragged(n: int, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_gpu_decode_llama3_sizes(dtype, block_size):
    for batch, lo, hi in ((64, 1, 4096), (3, 3000, 8192)):  # a full batch; a few long sequences (split-K)
        lens = _ragged(batch, lo, hi, seed=batch + block_size)
        case = make_case(
            **LLAMA3_8B,
            block_size=block_size,
            q_lens=[1] * batch,
            seq_lens=lens,
            dtype=dtype,
            device="cuda",
            seed=block_size,
        )
        for splits in (None, 1, 4):
            out = _poisoned(case)
            triton_backend.paged_attention(*case.args(), out=out) if splits is None else pa.paged_attention_decode(
                case.query,
                case.kv_cache,
                case.block_tables,
                case.seq_lens,
                case.scale,
                case.max_seq_len,
                out=out,
                num_splits=splits,
            )
            _check(out, case, f"gpu decode b={batch} bs={block_size} splits={splits}")


# Head dims x GQA ratios at real sizes (every combination compiles its own kernel, so the GPU run
# covers each head dim and each ratio rather than the full product; the interpreter tests cover it).
SHAPES = [(64, 32, 32), (80, 32, 8), (96, 64, 8), (128, 32, 32), (128, 64, 8)]
GPU_SHAPES = [
    pytest.param(dt, *shape, id=f"{str(dt)[6:]}-d{shape[0]}-gqa{shape[1] // shape[2]}")
    for dt in DTYPES
    for shape in (SHAPES if dt != torch.float32 else SHAPES[1:5:3])
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,num_heads,num_kv_heads", GPU_SHAPES)
def test_gpu_decode_head_dims_and_gqa(dtype, head_dim, num_heads, num_kv_heads):
    lens = _ragged(16, 1, 2000, seed=head_dim)
    case = make_case(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        q_lens=[1] * 16,
        seq_lens=lens,
        dtype=dtype,
        device="cuda",
        seed=head_dim,
    )
    out = _poisoned(case)
    triton_backend.paged_attention(*case.args(), out=out)
    _check(out, case, f"gpu decode d={head_dim} gqa={num_heads // num_kv_heads}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_gpu_prefill_llama3_sizes(dtype, block_size):
    # fresh 2048-token prompt, a 2048 chunk after 1500 cached tokens, a ragged extend, decode rows
    q_lens = [2048, 2048, 777, 1, 1]
    lens = [2048, 3548, 1234, 4000, 17]
    case = make_case(
        **LLAMA3_8B, block_size=block_size, q_lens=q_lens, seq_lens=lens, dtype=dtype, device="cuda", seed=block_size
    )
    out = _poisoned(case)
    triton_backend.paged_attention(*case.args(), out=out)
    _check(out, case, f"gpu prefill bs={block_size}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,num_heads,num_kv_heads", GPU_SHAPES)
def test_gpu_prefill_head_dims_and_gqa(dtype, head_dim, num_heads, num_kv_heads):
    q_lens, lens = [300, 1, 517], [300, 999, 1700]
    case = make_case(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        q_lens=q_lens,
        seq_lens=lens,
        dtype=dtype,
        device="cuda",
        seed=head_dim,
    )
    out = _poisoned(case)
    triton_backend.paged_attention(*case.args(), out=out)
    _check(out, case, f"gpu prefill d={head_dim} gqa={num_heads // num_kv_heads}")


@pytest.mark.gpu
def test_gpu_no_recompilation_across_lengths():
    """Lengths are data: new max lengths and batch sizes reuse the compiled kernels."""

    def run(batch, hi, q):
        lens = _ragged(batch, q, hi, seed=hi)
        case = make_case(
            **LLAMA3_8B, block_size=16, q_lens=[q] * batch, seq_lens=lens, dtype=torch.bfloat16, device="cuda", seed=hi
        )
        triton_backend.paged_attention(*case.args())

    def compiled():
        # device_caches: device -> (kernel cache, ...); one entry per compiled specialisation
        return sum(
            len(v[0])
            for k in (pa._decode_kernel, pa._decode_reduce_kernel, pa._prefill_kernel)
            for v in k.device_caches.values()
        )

    for batch, hi, q in ((2, 700, 1), (64, 900, 1), (2, 70, 5), (2, 700, 33)):
        run(batch, hi, q)  # warm every variant: split/unsplit decode, prefill
    before = compiled()
    for batch, hi, q in ((3, 5001, 1), (50, 1333, 1), (1, 3001, 1), (4, 2100, 129), (1, 77, 2)):
        run(batch, hi, q)
    assert compiled() == before


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_cache_ops_llama3_sizes(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    pool, bs = 4096, 16
    cache = torch.randn(2, pool, 8, bs, 128, generator=g, device="cuda").to(dtype)
    slots = torch.randperm(pool * bs, generator=g, device="cuda")[:8192]
    slots[::7] = -1
    qkv = torch.randn(8192, 48, 128, generator=g, device="cuda").to(dtype)
    key, value = qkv[:, 32:40], qkv[:, 40:]
    expected = cache.clone()
    reference.write_kv(key, value, expected, slots)
    cache_ops.write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)

    perm = torch.randperm(pool, generator=g, device="cuda")
    src, dst = perm[:500], perm[500:1000]
    reference.copy_blocks(expected, src, dst)
    cache_ops.copy_blocks(cache, src, dst)
    assert torch.equal(cache, expected)

    ids = perm[1000:1700]
    buf = cache_ops.gather_blocks(cache, ids)
    assert torch.equal(buf, reference.gather_blocks(cache, ids))
    new = torch.randn_like(buf, dtype=torch.float32).to(dtype)
    reference.scatter_blocks(expected, new, ids)
    cache_ops.scatter_blocks(cache, new, ids)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_step_runs_decodes_and_prefills_on_their_own_kernels(dtype):
    """Decode rows first (num_decodes), then prefill chunks: the split dispatch equals the reference."""
    q_lens, lens = [1, 1, 1, 1, 37, 5, 70], [40, 9, 130, 1, 37, 60, 200]
    case = make_case(
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        q_lens=q_lens,
        seq_lens=lens,
        dtype=dtype,
        device=DEVICE,
        seed=99,
    )
    out = _poisoned(case)
    triton_backend.paged_attention(*case.args(), out=out, num_decodes=4)
    _check(out, case, "mixed")


def test_prefill_from_a_first_sequence_leaves_the_earlier_rows_alone():
    case = make_case(
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=8,
        q_lens=[3, 20, 9],
        seq_lens=[10, 20, 40],
        dtype=torch.float32,
        device=DEVICE,
        seed=5,
    )
    out = _poisoned(case)
    pa.paged_attention_prefill(*case.args()[:7], out=out, first_seq=1)
    assert torch.isnan(out[:3]).all()  # sequence 0's rows: untouched
    ref = reference.paged_attention(*case.args())
    torch.testing.assert_close(out[3:], ref[3:], rtol=1e-5, atol=1e-5)
