"""Lower bounds for a tensor-parallel run, per rank and per step, from the device's measured peaks (issue 36).

The scheduler's own steps (benchmarks/step_roofline.py records them from its plans) are costed on one rank:

    compute    every layer's four GEMMs (QKV, output projection, gate/up, down), each at
               max(FLOPs / peak matmul rate, its weight bytes / peak read bandwidth), the layer's attention at
               max(FLOPs / peak matmul rate, KV bytes / peak read bandwidth), and the LM head over the sampled
               rows likewise.  Norms, rotary, the activation, the embedding and the logits' all-gather are
               left out: a lower bound may leave work out, never count work that need not be done.
    all-reduce 2 per layer and 1 for the embedding, each of tokens x hidden x dtype bytes, at the time this
               host's GPUs took for that size (benchmarks/allreduce.py: the fastest of back-to-back rounds,
               eager and inside a CUDA graph).  A size that was not measured takes the time of the largest
               measured size below it, after the table is made non-decreasing from above (a size never
               costs more than any larger one measured), so an unmeasured size is never overcharged.

    serial      = sum over steps of layers x (compute + all-reduce) per layer + the embedding's + the LM head
    overlapped  = sum over steps of layers x max(compute, all-reduce) per layer (the embedding's all-reduce
                  counted with the first layer's) + the LM head: the all-reduces hidden completely

Token counts are the steps' real ones (the engine pads a step to a graph's size; an engine need not).  The
peaks are the largest rates any of several kernels reached (`measure_peaks`): a copy and a read-only sum of
2 GiB, GEMVs over weights far larger than L2, square and model-shaped GEMMs, each timed as the fastest of
several rounds.  So a run measured above its bound (a fraction > 1.0) means the bound is wrong, and the
result says so.  The GEMMs are counted one by one because the engine launches them one by one; an engine
that fused two could beat this bound.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from benchmarks.step_roofline import StepShape


@dataclass(frozen=True)
class RankModel:
    """One rank's share of a Llama-shaped model: its GEMMs as (out, in) and its attention heads."""

    tp: int
    layers: int
    hidden: int
    heads: int  # query heads on this rank
    kv_heads: int  # key/value heads on this rank (one replicated head when there are fewer than ranks)
    head_dim: int
    intermediate: int  # this rank's share
    vocab: int  # this rank's LM-head rows (padded)
    dtype_bytes: int

    @classmethod
    def of(cls, cfg: dict[str, Any], tp: int, dtype_bytes: int) -> RankModel:
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        return cls(
            tp=tp,
            layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            heads=heads // tp,
            kv_heads=max(1, kv // tp),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate=cfg["intermediate_size"] // tp,
            vocab=-(-cfg["vocab_size"] // tp),
            dtype_bytes=dtype_bytes,
        )

    def gemms(self) -> list[tuple[int, int]]:
        """(out, in) of each projection of a layer, in order: QKV, output, gate/up, down."""
        d = self.head_dim
        return [
            ((self.heads + 2 * self.kv_heads) * d, self.hidden),
            (self.hidden, self.heads * d),
            (2 * self.intermediate, self.hidden),
            (self.hidden, self.intermediate),
        ]

    def allreduce_bytes(self, tokens: int) -> int:
        return tokens * self.hidden * self.dtype_bytes


@dataclass(frozen=True)
class Peaks:
    matmul_flops: float  # FLOP/s
    bytes_per_s: float  # bytes read (or read + written by a copy) per second

    def op_seconds(self, flops: float, nbytes: float) -> float:
        return max(flops / self.matmul_flops, nbytes / self.bytes_per_s)


class AllReduceTable:
    """Measured all-reduce seconds by message size, read as a lower bound (see the module docstring)."""

    def __init__(self, seconds_by_size: dict[int, float]) -> None:
        sizes = sorted(seconds_by_size)
        self.sizes = sizes
        self.measured = dict(seconds_by_size)
        envelope: dict[int, float] = {}
        lowest = math.inf
        for size in reversed(sizes):  # non-decreasing: never more than a larger size took
            lowest = min(lowest, seconds_by_size[size])
            envelope[size] = lowest
        self.envelope = envelope

    @classmethod
    def from_result(cls, result: dict[str, Any]) -> AllReduceTable:
        """From benchmarks/allreduce.py's {size: {"seconds": ...}} for one group size."""
        return cls({int(size): float(row["seconds"]) for size, row in result.items()})

    def seconds(self, nbytes: int) -> tuple[float, bool]:
        """(a lower bound on the time of one all-reduce of `nbytes`, whether that size was measured itself)."""
        if nbytes <= 0:
            return 0.0, True
        below = [s for s in self.sizes if s <= nbytes]
        if not below:
            return 0.0, False  # smaller than anything measured: nothing is known, so nothing is charged
        return self.envelope[below[-1]], below[-1] == nbytes


def keys_seen(step: StepShape) -> float:
    """Query-key pairs of a causal step: each new token attends to its context and the new tokens before it."""
    return sum(n * start + n * (n + 1) / 2 for start, n in step.seqs)


def step_bounds(step: StepShape, m: RankModel, peaks: Peaks, allreduce: AllReduceTable | None) -> dict[str, Any]:
    """One step's compute and all-reduce lower bounds on one rank, serial and overlapped, in seconds."""
    tokens = step.tokens
    gemm = sum(peaks.op_seconds(2 * tokens * n * k, n * k * m.dtype_bytes) for n, k in m.gemms())
    kv_bytes = sum(start + n for start, n in step.seqs) * 2 * m.kv_heads * m.head_dim * m.dtype_bytes
    attention = peaks.op_seconds(4 * m.heads * m.head_dim * keys_seen(step), kv_bytes)
    layer_compute = gemm + attention
    head = 0.0
    if step.samples:
        head = peaks.op_seconds(2 * step.samples * m.vocab * m.hidden, m.vocab * m.hidden * m.dtype_bytes)
    one, exact = (0.0, True) if allreduce is None or m.tp == 1 else allreduce.seconds(m.allreduce_bytes(tokens))
    layer_allreduce = 2 * one
    serial = m.layers * (layer_compute + layer_allreduce) + one + head
    overlapped = max(layer_compute, layer_allreduce + one) + (m.layers - 1) * max(layer_compute, layer_allreduce) + head
    return {
        "compute_s": m.layers * layer_compute + head,
        "gemm_s": m.layers * gemm + head,
        "attention_s": m.layers * attention,
        "allreduce_s": m.layers * layer_allreduce + one,
        "allreduces": (2 * m.layers + 1) if m.tp > 1 else 0,
        "allreduce_exact": exact,
        "serial_s": serial,
        "overlapped_s": overlapped,
    }


def run_bounds(
    steps: Iterable[StepShape], m: RankModel, peaks: Peaks, allreduce: AllReduceTable | None
) -> dict[str, Any]:
    """The run's bounds (sums over its steps), and the all-reduces it did by message size."""
    totals = dict.fromkeys(("compute_s", "gemm_s", "attention_s", "allreduce_s", "serial_s", "overlapped_s"), 0.0)
    sizes: dict[int, dict[str, Any]] = {}
    count = 0
    for step in steps:
        count += 1
        b = step_bounds(step, m, peaks, allreduce)
        for key in totals:
            totals[key] += b[key]
        if b["allreduces"]:
            nbytes = m.allreduce_bytes(step.tokens)
            row = sizes.setdefault(nbytes, {"tokens": step.tokens, "bytes": nbytes, "allreduces": 0, "seconds": 0.0})
            row["allreduces"] += b["allreduces"]
            row["seconds"] += b["allreduce_s"]
            row["measured_exactly"] = b["allreduce_exact"]
    by_size = sorted(sizes.values(), key=lambda r: -r["seconds"])
    for row in by_size:
        row["seconds"] = round(row["seconds"], 4)
    return {
        "steps": count,
        **{k: round(v, 4) for k, v in totals.items()},
        "allreduce_by_size": by_size,
        "allreduce_seconds_measured_exactly": round(sum(r["seconds"] for r in by_size if r.get("measured_exactly")), 4),
    }


# -- the peaks ---------------------------------------------------------------------------------------------------


def _fastest(fn: Callable[[], object], device: torch.device, repeats: int, rounds: int = 5) -> float:
    """Seconds of one call of `fn`: the fastest of `rounds` rounds of `repeats` back-to-back calls."""
    fn()  # warm-up (kernel choice, compilation)
    best = math.inf
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t = time.perf_counter()
            for _ in range(repeats):
                fn()
            seconds = time.perf_counter() - t
        best = min(best, seconds / repeats)
    return best


def measure_peaks(
    device: torch.device,
    dtype: torch.dtype,
    gemms: list[tuple[int, int]],
    big_rows: list[int],
    small_rows: list[int],
    stream_bytes: int = 2 << 30,
    square: int = 8192,
    cold_bytes: int = 1 << 30,
) -> dict[str, Any]:
    """The largest matmul rate and read bandwidth any candidate kernel reached on `device`, with each candidate's.

    Matmul: a `square`^3 product and every (out, in) of `gemms` at each of `big_rows` rows.  Bandwidth: a copy of
    `stream_bytes` (bytes read + written), a read-only sum over them, and every (out, in) at each of `small_rows`
    rows by weight bytes read, cycling through enough copies of the weight (`cold_bytes` in all) that L2 never
    holds the one read next.  All on random data (an all-zero product runs faster)."""
    size = torch.empty((), dtype=dtype).element_size()
    matmul: dict[str, float] = {}
    bandwidth: dict[str, float] = {}

    def gemm(rows: int, n: int, k: int, copies: int = 1) -> float:
        x = torch.randn(rows, k, device=device, dtype=dtype)
        ws = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(copies)]
        turn = [0]

        def run() -> None:
            torch.nn.functional.linear(x, ws[turn[0] % copies])
            turn[0] += 1

        return _fastest(run, device, repeats=max(copies, 4))

    matmul[f"square {square}"] = 2 * square**3 / _square_seconds(square, device, dtype)
    for n, k in sorted(set(gemms)):
        for rows in big_rows:
            matmul[f"{rows}x{n}x{k}"] = 2 * rows * n * k / gemm(rows, n, k)
        copies = max(1, -(-cold_bytes // (n * k * size)))
        for rows in small_rows:
            bandwidth[f"{rows}x{n}x{k} (weights)"] = n * k * size / gemm(rows, n, k, copies)
    copy_s, sum_s = _stream_seconds(stream_bytes, device)
    bandwidth["copy"] = 2 * stream_bytes / copy_s
    bandwidth["sum"] = stream_bytes / sum_s
    best_matmul = max(matmul, key=lambda key: matmul[key])
    best_bandwidth = max(bandwidth, key=lambda key: bandwidth[key])
    return {
        "matmul_flops": matmul[best_matmul],
        "matmul_from": best_matmul,
        "bytes_per_s": bandwidth[best_bandwidth],
        "bytes_from": best_bandwidth,
        "matmul_TFLOPs_by_kernel": {key: round(v / 1e12, 1) for key, v in matmul.items()},
        "read_TBps_by_kernel": {key: round(v / 1e12, 3) for key, v in bandwidth.items()},
    }


def _square_seconds(n: int, device: torch.device, dtype: torch.dtype) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    return _fastest(lambda: a @ a, device, repeats=4)


def _stream_seconds(nbytes: int, device: torch.device) -> tuple[float, float]:
    """(seconds of a copy of `nbytes`, of a read-only sum over them)."""
    src = torch.randint(0, 127, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    wide = src.view(torch.int32) if nbytes % 4 == 0 else src
    return _fastest(lambda: dst.copy_(src), device, repeats=2), _fastest(lambda: wide.sum(), device, repeats=2)
