"""The tensor-parallel lower bounds (benchmarks/tp_bounds.py): one step worked out by hand, the all-reduce table
read as a bound, the serial and overlapped sums, and the peaks' measurement on the CPU (the same code as on a GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.step_roofline import StepShape
from benchmarks.tensor_parallel import LLAMA31_70B, allreduce_sizes
from benchmarks.tp_bounds import AllReduceTable, Peaks, RankModel, measure_peaks, run_bounds, step_bounds

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 100,
}


def test_a_bandwidth_bound_step_worked_out_by_hand():
    m = RankModel.of(TINY, tp=2, dtype_bytes=2)
    assert m.gemms() == [(64, 64), (64, 32), (128, 64), (64, 64)] and m.vocab == 50 and m.kv_heads == 1
    peaks = Peaks(matmul_flops=1e15, bytes_per_s=1e9)  # every operation is bound by its bytes
    table = AllReduceTable({1024: 1e-5, 4096: 2e-5})
    b = step_bounds(StepShape(((0, 10),), samples=1), m, peaks, table)
    # per layer: the four weights (4096 + 2048 + 8192 + 4096 elements x 2 bytes), the KV of 10 tokens (1 head of 16
    # for K and V, 2 bytes); the LM head's 50 x 64 x 2 bytes; each all-reduce of 10 x 64 x 2 = 1,280 bytes takes
    # the time of 1,024 (the largest measured size below it)
    layer = 18432 * 2 / 1e9 + 10 * 2 * 16 * 2 / 1e9
    head = 50 * 64 * 2 / 1e9
    assert b["compute_s"] == pytest.approx(2 * layer + head)
    assert b["allreduce_s"] == pytest.approx(5e-5) and b["allreduces"] == 5 and not b["allreduce_exact"]
    assert b["serial_s"] == pytest.approx(2 * (layer + 2e-5) + 1e-5 + head)
    assert b["overlapped_s"] == pytest.approx(max(layer, 3e-5) + max(layer, 2e-5) + head)


def test_a_compute_bound_step_counts_the_flops():
    m = RankModel.of(TINY, tp=1, dtype_bytes=2)
    peaks = Peaks(matmul_flops=1e9, bytes_per_s=1e15)
    b = step_bounds(StepShape(((5, 20),), samples=0), m, peaks, None)
    gemm = sum(2 * 20 * n * k for n, k in m.gemms()) / 1e9
    attention = 4 * 4 * 16 * (20 * 5 + 20 * 21 / 2) / 1e9  # every new token's keys: its context and itself causally
    assert b["compute_s"] == pytest.approx(2 * (gemm + attention))  # no sample: no LM head
    assert b["allreduce_s"] == 0 and b["serial_s"] == b["overlapped_s"] == b["compute_s"]


def test_the_all_reduce_table_never_overcharges_an_unmeasured_size():
    table = AllReduceTable({1000: 5.0, 2000: 3.0, 4000: 4.0})  # 1000 measured slower than 2000: noise
    assert table.seconds(2000) == (3.0, True)
    assert table.seconds(1500) == (3.0, False)  # 1,000's time made non-decreasing from above
    assert table.seconds(1000) == (3.0, True)
    assert table.seconds(9000) == (4.0, False)
    assert table.seconds(500) == (0.0, False)  # below every measured size: nothing known, nothing charged
    assert AllReduceTable.from_result({"2048": {"seconds": 1e-5, "busbw_GBps": 1.0}}).seconds(2048) == (1e-5, True)


def test_the_overlapped_bound_is_below_the_serial_one_and_the_run_adds_its_steps():
    rng = random.Random(5)
    m = RankModel.of(LLAMA31_70B, tp=4, dtype_bytes=2)
    assert m.gemms() == [(2560, 8192), (8192, 2048), (14336, 8192), (8192, 7168)] and m.vocab == 32064
    sizes = allreduce_sizes([8192], 2, 256, 8192)
    table = AllReduceTable({s: 1e-5 + s / 200e9 for s in sizes})
    peaks = Peaks(800e12, 3.3e12)
    steps = [
        StepShape(
            tuple((rng.randrange(0, 600), rng.choice([1, 1, 1, 37, 512])) for _ in range(rng.randrange(1, 40))), 3
        )
        for _ in range(50)
    ]
    total = run_bounds(steps, m, peaks, table)
    singles = [step_bounds(s, m, peaks, table) for s in steps]
    assert total["steps"] == 50
    assert total["serial_s"] == pytest.approx(sum(b["serial_s"] for b in singles), rel=1e-3)
    assert all(b["overlapped_s"] <= b["serial_s"] for b in singles)
    assert all(max(b["compute_s"], b["allreduce_s"]) <= b["overlapped_s"] * (1 + 1e-9) for b in singles)
    assert sum(r["allreduces"] for r in total["allreduce_by_size"]) == 50 * 161
    assert sum(r["seconds"] for r in total["allreduce_by_size"]) == pytest.approx(total["allreduce_s"], rel=1e-3)


def test_the_sizes_measured_cover_the_workloads_steps_exactly():
    sizes = allreduce_sizes([4096, 8192], 2, 256, 8192)
    for tokens in (1, 256, 4096, 8192):  # batch-1, a full decode batch, a micro-batch, a full prefill step
        assert tokens * 4096 * 2 in sizes and tokens * 8192 * 2 in sizes
    assert max(sizes) == 8192 * 8192 * 2 and len(sizes) <= 30


def test_the_peaks_are_the_fastest_kernel_of_each_kind():
    found = measure_peaks(
        torch.device("cpu"),
        torch.float32,
        [(64, 32), (96, 32)],
        [32],
        [1],
        stream_bytes=1 << 20,
        square=64,
        cold_bytes=1 << 16,
    )
    print(
        f"\nCPU peaks: {found['matmul_flops'] / 1e9:.1f} GFLOP/s from {found['matmul_from']}, "
        f"{found['bytes_per_s'] / 1e9:.1f} GB/s from {found['bytes_from']}"
    )
    assert found["matmul_flops"] / 1e12 == pytest.approx(max(found["matmul_TFLOPs_by_kernel"].values()), abs=0.06)
    assert set(found["matmul_TFLOPs_by_kernel"]) == {"square 64", "32x64x32", "32x96x32"}
    assert {"copy", "sum", "1x64x32 (weights)", "1x96x32 (weights)"} == set(found["read_TBps_by_kernel"])
    assert found["bytes_from"] in found["read_TBps_by_kernel"] and found["bytes_per_s"] > 0
