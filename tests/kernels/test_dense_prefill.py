"""Fresh chunks on the dense path (kernels/dense_prefill.py) against the float64 oracle.

A step lists its decodes first, then chunks that read cached context (the paged kernels), then fresh
chunks (no context before them) as runs of equal lengths, which attend over the step's own K/V.  The
output is poisoned with NaN first, so a row that no path wrote fails; the paged kernels must leave the
dense rows alone (`num_seqs`).  Without a GPU the Triton kernels run in the interpreter and the dense
runs on torch's CPU attention; the `gpu` test runs Llama-3-8B sizes on cuDNN.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import cpu_backend, triton_backend  # noqa: E402
from kernels import paged_attention as pa  # noqa: E402
from kernels.dense_prefill import (  # noqa: E402
    DenseChunks,
    DenseRun,
    batch_pieces,
    bucket_length,
    cudnn_refusal,
    dense_prefill,
    dense_shapes,
    is_planned_length,
    runs_of,
)
from tests.kernels.paged_cases import TOLERANCE, make_case, reference_fp64, rel_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fresh_kv(case) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V of every query row as the step computed them: what the cache holds at the row's position."""
    bs = case.kv_cache.shape[3]
    rows = []
    for b, (ql, length) in enumerate(zip(case.q_lens, case.lens)):
        pos = torch.arange(length - ql, length, device=case.kv_cache.device)
        blocks = case.block_tables[b].long()[pos // bs]
        rows.append(case.kv_cache.permute(0, 1, 3, 2, 4)[:, blocks, pos % bs])  # [2, ql, Hkv, D]
    kv = torch.cat(rows, dim=1)
    return kv[0], kv[1]


def _dense_of(case, first_dense: int) -> DenseChunks:
    rows = int(case.query_start_loc[first_dense])
    paged = case.q_lens[:first_dense]
    return DenseChunks(
        runs_of(case.q_lens[first_dense:], rows),
        len(case.q_lens) - first_dense,
        max((q for q in paged if q > 1), default=0),
    )


def test_runs_group_adjacent_equal_lengths():
    assert runs_of([7, 7, 12, 12, 12, 30], 5) == (DenseRun(5, 2, 7), DenseRun(19, 3, 12), DenseRun(55, 1, 30))
    assert runs_of([], 0) == ()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_mixed_step_with_fresh_chunks_equals_the_oracle(dtype):
    # two decodes, two chunks after cached context, then fresh chunks 9, 9 (one run) and 21
    q_lens = [1, 1, 6, 13, 9, 9, 21]
    lens = [30, 7, 40, 13 + 50, 9, 9, 21]
    case = make_case(
        num_heads=8, num_kv_heads=2, head_dim=32, block_size=8, q_lens=q_lens, seq_lens=lens, dtype=dtype, device=DEVICE
    )
    dense = _dense_of(case, 4)
    assert dense.runs == (DenseRun(21, 2, 9), DenseRun(39, 1, 21))
    out = torch.full_like(case.query, float("nan"))
    triton_backend.paged_attention(*case.args(), out=out, num_decodes=2, dense=dense, fresh_kv=_fresh_kv(case))
    err = rel_error(out, reference_fp64(case))
    print(f"triton + dense {dtype}: relative error {err:.2e}")
    assert err <= TOLERANCE[dtype]


def test_the_paged_prefill_leaves_the_dense_rows_alone():
    case = make_case(
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=8,
        q_lens=[3, 20, 9],
        seq_lens=[10, 20, 9],
        dtype=torch.float32,
    )
    out = torch.full_like(case.query, float("nan"))
    pa.paged_attention_prefill(*case.args()[:7], out=out, first_seq=0, num_seqs=2)
    assert torch.isnan(out[23:]).all()  # sequence 2's rows: untouched
    assert not torch.isnan(out[:23]).any()


def test_the_cpu_backend_takes_the_same_dense_runs():
    q_lens, lens = [1, 6, 9, 9, 21], [30, 40, 9, 9, 21]
    case = make_case(
        num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, q_lens=q_lens, seq_lens=lens, dtype=torch.float32
    )
    k, v = _fresh_kv(case)
    nhd = case.kv_cache.permute(0, 1, 3, 2, 4).contiguous()  # the CPU backend's layout
    args = (case.query, nhd, *case.args()[2:])
    out = cpu_backend.paged_attention(*args, num_decodes=1, dense=_dense_of(case, 2), fresh_kv=(k, v))
    err = rel_error(out, reference_fp64(case))
    print(f"cpu backend + dense: relative error {err:.2e}")
    assert err <= TOLERANCE[torch.float32]


def test_buckets_bound_the_shapes():
    assert [bucket_length(n, 1024) for n in (1, 1024, 1025, 1537, 3000, 3073, 8192)] == [
        1024,
        1024,
        1536,
        2048,
        3072,
        4096,
        8192,
    ]
    assert batch_pieces(7) == [4, 2, 1] and batch_pieces(8) == [8]
    assert [n for n in range(1, 9000) if is_planned_length(n, 1024)] == [1024, 1536, 2048, 3072, 4096, 6144, 8192]
    shapes = dense_shapes(1024, 8192)
    assert len(shapes) == 16 and (8, 1024) in shapes and (1, 8192) in shapes
    # every call a step of at most 8,192 tokens can make is among them
    for length in range(1024, 8193, 97):
        for num in range(1, 8192 // length + 1):
            for n in batch_pieces(num):
                assert (n, bucket_length(length, 1024)) in shapes, (num, length)


def test_power_of_two_batches_change_nothing_and_a_whole_step_is_not_copied():
    """Runs split into power-of-two batches (the bound on cuDNN's plans) give the unsplit result; a step that is one
    call returns the kernel's output without a copy into a new tensor."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3 * 21 + 10, 8, 32, generator=g)
    k, v = torch.randn(73, 2, 32, generator=g), torch.randn(73, 2, 32, generator=g)
    dense = DenseChunks(runs_of([10, 21, 21, 21], 0), 4, 0)
    exact = dense_prefill(q, k, v, dense, 0.3, torch.empty_like(q))
    split = dense_prefill(q, k, v, dense, 0.3, None, pow2_batches=True)  # 3 sequences of 21 -> 2 + 1
    torch.testing.assert_close(split, exact, rtol=1e-5, atol=1e-5)
    whole = DenseChunks(runs_of([21, 21], 0), 2, 0)
    rows = q[:42], k[:42], v[:42]
    mine = dense_prefill(*rows, whole, 0.3, None, pow2_batches=True)
    into = dense_prefill(*rows, whole, 0.3, torch.empty_like(q[:42]))
    torch.testing.assert_close(mine, into, rtol=0, atol=0)
    assert mine.shape == (42, 8, 32)


def test_dense_chunks_without_their_kv_are_refused():
    case = make_case(
        num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, q_lens=[9], seq_lens=[9], dtype=torch.float32
    )
    with pytest.raises(ValueError, match="fresh_kv"):
        triton_backend.paged_attention(*case.args(), dense=_dense_of(case, 0))


def test_no_dense_path_for_float32_or_an_fp8_cache():
    cpu = torch.device("cpu")
    assert triton_backend.dense_prefill_lengths(torch.float32, torch.float32, 32, 8, 128, cpu) is None
    fp8 = torch.float8_e4m3fn
    assert triton_backend.dense_prefill_lengths(torch.bfloat16, fp8, 32, 8, 128, cpu) is None
    assert cpu_backend.dense_prefill_lengths(torch.bfloat16, fp8, 32, 8, 128, cpu) is None


def test_a_remembered_cudnn_answer_skips_the_probe_and_chunks_wait_for_their_plans(monkeypatch):
    """An earlier start's probe answer (engine/runner/probe_cache.py) is taken as it is (the probe's first cuDNN
    call costs seconds), and no chunk goes to cuDNN before its shapes are planned (after serving starts)."""
    from kernels import dense_prefill as dp

    probed = []
    monkeypatch.setattr(dp, "_probe_cudnn", lambda *a: probed.append(a))
    monkeypatch.setattr(triton_backend, "_WARMED", set())
    cpu = torch.device("cpu")
    dp.remember_cudnn_refusal(torch.bfloat16, 12, 4, 64, "cpu", None)
    takes = triton_backend.dense_prefill_lengths(torch.bfloat16, torch.bfloat16, 12, 4, 64, cpu)
    assert takes is not None and not probed
    assert not takes(1024) and not takes(2048)
    triton_backend._WARMED.add((torch.bfloat16, 12, 4, 64, "cpu"))  # what warm_dense_prefill records
    assert takes(1024) and takes(2048) and not takes(1100)
    dp.remember_cudnn_refusal(torch.bfloat16, 12, 4, 48, "cpu", "no cuDNN here")
    assert triton_backend.dense_prefill_lengths(torch.bfloat16, torch.bfloat16, 12, 4, 48, cpu) is None
    assert not probed


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_fresh_chunks_on_cudnn_llama3_sizes(dtype):
    """Decodes, a 2,048 chunk after 1,500 cached tokens, and fresh 1,536 and 2,048 x 2 prompts;
    then a step of the two 2,048-token prompts alone (the kernel's output returned without a copy)."""
    why = cudnn_refusal(dtype, 32, 8, 128, "cuda")
    print(f"cuDNN for fresh chunks: {'on' if why is None else 'off: ' + why}")
    q_lens = [1, 1, 2048, 1536, 2048, 2048]
    lens = [4000, 17, 3548, 1536, 2048, 2048]
    case = make_case(
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        q_lens=q_lens,
        seq_lens=lens,
        dtype=dtype,
        device="cuda",
    )
    # fresh chunks shortest first, as the runner lists them
    dense = _dense_of(case, 3)
    assert dense.runs == (DenseRun(2050, 1, 1536), DenseRun(3586, 2, 2048))
    takes = triton_backend.dense_prefill_lengths(dtype, dtype, 32, 8, 128, torch.device("cuda"))
    if why is not None:  # this GPU's cuDNN cannot take the layout: the engine keeps every chunk paged
        assert takes is None
        return
    assert takes is not None and not takes(1536)  # nothing planned yet: the paged kernel plans nothing
    triton_backend.warm_dense_prefill(dtype, 32, 8, 128, torch.device("cuda"), 8192)
    assert takes(1536) and takes(2048) and not takes(1100) and not takes(512)
    out = torch.full_like(case.query, float("nan"))
    triton_backend.paged_attention(*case.args(), out=out, num_decodes=2, dense=dense, fresh_kv=_fresh_kv(case))
    err = rel_error(out, reference_fp64(case))
    print(f"gpu triton + cuDNN {dtype}: relative error {err:.2e}")
    assert err <= TOLERANCE[dtype]

    fresh = make_case(
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        q_lens=[2048] * 2,
        seq_lens=[2048] * 2,
        dtype=dtype,
        device="cuda",
    )
    out = triton_backend.paged_attention(*fresh.args(), dense=_dense_of(fresh, 0), fresh_kv=_fresh_kv(fresh))
    err = rel_error(out, reference_fp64(fresh))
    print(f"gpu cuDNN whole step {dtype}: relative error {err:.2e}")
    assert err <= TOLERANCE[dtype]
