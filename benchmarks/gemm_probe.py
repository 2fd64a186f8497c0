"""Can the decode step's bf16 projection GEMMs run faster than F.linear's cuBLAS? (GPU)

    python -m benchmarks.gemm_probe [--shape 8b|70b-tp4] [--ms 256,320,...] [--reps 10] [--rounds 7] [--quick]
                                    [--skip-triton] [--variants default,triton,...] [--tag WORD] [--note TEXT]
                                    [--out DIR]

Why: a 256-sequence decode step of Llama-3-8B spends ~7 ms in its 32 layers x 4 projections (qkv 4096->6144,
o 4096->4096, gate_up 4096->28672, down 14336->4096), about 72% of the ridge bound max(FLOPs / matmul rate,
weight bytes / copy bandwidth).  This asks whether another way of running the very same products closes part of
that gap, at the decode M (256) and at the padded mixed-step buckets (320..1024).

`--shape 70b-tp4` asks the same of one rank of Llama-3.1-70B at tensor parallel 4 (80 layers; qkv 8192->2560,
o 2048->8192, gate_up 8192->14336, down 7168->8192), the products each of the four GPUs runs, at decode M (256)
and at a prefill chunk (M up to 8192); issue 36's 0.80-of-bound target is judged against it
(docs/decisions/tp-bound-target.md).  The variants:

- `default`: F.linear(x, W), W [N, K] as nn.Linear stores it (torch's choice of cuBLAS library and kernel);
- `cublas` / `cublaslt`: the same with torch.backends.cuda.preferred_blas_library set (restored afterwards);
- `pretransposed`: W stored [K, N] contiguous and torch.mm(x, Wt), in case cuBLAS picks another kernel;
- `tunableop`: F.linear with torch.cuda.tunable enabled, tuned in-process first (no results file is kept);
- `gate_up_split2` / `gate_up_split4`: gate_up as 2 or 4 products over row blocks of W (the rest as default);
- `triton`: this file's own Triton matmul (pointer loads or TMA descriptor loads, optional split-K with an fp32
  workspace and a reduce kernel), tuned per (M, N, K) over tile shape, warps, stages and split-K, each candidate
  checked against F.linear;
- `triton_o_down`, `cublaslt_down`: fixed mixes (Triton for the N=hidden products o and down; cuBLASLt for down),
  the rest as default;
- `best_per_projection`: per projection the fastest of the above at that M, captured together as one step and
  timed interleaved with the default (`default_paired`).

`--variants a,b,...` times a subset (default always), `--tag WORD` names its JSON apart, `--note TEXT` is kept in
its `notes` (the commit measured, say, where the device's checkout cannot tell).

Each variant's step (the shape's layers x 4 projections, 4 distinct weight sets cycled so the weights exceed the
L2, as in benchmarks.overlap_probe) is captured once in a CUDA graph, as the engine replays decode steps, and so is
each projection alone (one call per layer).  The graphs of one M are then timed in --rounds interleaved rounds, the
order rotated each round (a first run that timed variants one after the other saw the same kernels differ by up to
4% between moments); per round the median of --reps back-to-back replays between CUDA events, and the reported ms is the
median over rounds.  `cublas` and (when it tuned to "Default") `tunableop` run the very kernels of `default` where
cuBLAS is torch's default library: their spread (`same_kernel_spread_pct`) is the noise to judge gains against.
`default_eager` (one eager measurement) ties back to the overlap probe's convention.  Reported per variant and M:
ms, TFLOP/s and the fraction of the ridge bound (bound_ms / ms), with the matmul rate and copy bandwidth measured in
the same run by benchmarks.throughput.

JSON: `<out>/gemm-probe-<gpu>[-<shape>][-<tag>]-<date>.json` (no shape word for 8b).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from benchmarks.kernels import gpu_slug
from benchmarks.throughput import RESULTS, copy_bandwidth, matmul_rate

try:  # the CPU-only CI may lack Triton; the probe itself needs a GPU anyway
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


class Shape(NamedTuple):
    layers: int
    projections: dict[str, tuple[int, int]]  # name: (K, N) of one rank's weight, stored [N, K] as nn.Linear

    @property
    def weight_bytes(self) -> int:
        """One rank's bf16 projection weights over all layers."""
        return self.layers * sum(2 * k * n for k, n in self.projections.values())


def llama_shape(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, layers: int, tp: int = 1) -> Shape:
    """A Llama layer's four projections as one of `tp` tensor-parallel ranks holds them: qkv and gate_up split by
    output columns, o and down by input rows (heads, KV heads and the intermediate size divide by tp)."""
    assert heads % tp == 0 and kv_heads % tp == 0 and inter % tp == 0
    return Shape(
        layers,
        {
            "qkv": (hidden, (heads + 2 * kv_heads) * head_dim // tp),
            "o": (heads * head_dim // tp, hidden),
            "gate_up": (hidden, 2 * inter // tp),
            "down": (inter // tp, hidden),
        },
    )


SHAPES = {  # --shape: Llama-3-8B on one GPU, Llama-3.1-70B per rank at tensor parallel 4
    "8b": llama_shape(4096, 14336, 32, 8, 128, 32),
    "70b-tp4": llama_shape(8192, 28672, 64, 8, 128, 80, tp=4),
}
WEIGHT_SETS = 4
DEFAULT_MS = (256, 320, 512, 768, 1024, 128)
VARIANTS = (
    "default",
    "cublas",
    "cublaslt",
    "pretransposed",
    "gate_up_split2",
    "gate_up_split4",
    "tunableop",
    "triton",
    "triton_o_down",
    "cublaslt_down",
)

# -- the Triton matmul: y[M, N] = x[M, K] @ W[N, K]^T -------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _tile_of(pid, M, BLOCK_M: tl.constexpr):
        # M-blocks vary fastest: the programs that share one W tile run side by side, so W is read from HBM once
        num_m = tl.cdiv(M, BLOCK_M)
        return pid % num_m, pid // num_m

    @triton.jit
    def _write(acc, y_ptr, ws_ptr, pid_k, M, N, stride_ym, offs_m, offs_n, PARTIAL: tl.constexpr):
        keep = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if PARTIAL:  # split-K: this split's fp32 partial sums, reduced by _splitk_sum
            dst = ws_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
            tl.store(dst, acc, mask=keep)
        else:
            dst = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
            tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _mm_ptr_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        ws_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        k_span,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        PARTIAL: tl.constexpr,
    ):
        pid_m, pid_n = _tile_of(tl.program_id(0), M, BLOCK_M)
        pid_k = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # rows past M / columns past N read a valid row instead (their results are never stored): no load masks
        rows = tl.minimum(offs_m, M - 1)
        cols = tl.minimum(offs_n, N - 1)
        k0 = pid_k * k_span
        k_end = tl.minimum(K, k0 + k_span)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :]
        b_ptrs = w_ptr + cols[None, :] * stride_wn + (k0 + ks)[:, None]  # a [BLOCK_K, BLOCK_N] view of W^T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k0, k_end, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                inside = (k + ks) < k_end
                a = tl.load(a_ptrs, mask=inside[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=inside[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        _write(acc, y_ptr, ws_ptr, pid_k, M, N, stride_ym, offs_m, offs_n, PARTIAL)

    @triton.jit
    def _mm_tma_kernel(
        x_desc,
        w_desc,
        y_ptr,
        ws_ptr,
        M,
        N,
        K,
        stride_ym,
        k_span,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PARTIAL: tl.constexpr,
    ):
        # the tiles come through tensor descriptors (TMA on Hopper); out-of-range rows and columns read as zeros
        pid_m, pid_n = _tile_of(tl.program_id(0), M, BLOCK_M)
        pid_k = tl.program_id(1)
        k0 = pid_k * k_span
        k_end = tl.minimum(K, k0 + k_span)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k0, k_end, BLOCK_K):
            a = x_desc.load([pid_m * BLOCK_M, k])
            b = w_desc.load([pid_n * BLOCK_N, k])
            acc = tl.dot(a, b.T, acc)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _write(acc, y_ptr, ws_ptr, pid_k, M, N, stride_ym, offs_m, offs_n, PARTIAL)

    @triton.jit
    def _splitk_sum(ws_ptr, y_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < MN
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            total += tl.load(ws_ptr + s * MN + offs, mask=keep, other=0.0)
        tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=keep)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, split_k, tma)
Config = tuple[int, int, int, int, int, int, bool]
_TILES = [
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (128, 128, 128, 8, 3),
    (64, 128, 64, 4, 5),
    (64, 128, 128, 4, 4),
    (64, 256, 64, 4, 4),
]
_TILES += [(256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (128, 64, 128, 4, 4)]
_SPLIT_TILES = [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 128, 4, 4)]


def triton_configs(quick: bool = False) -> list[Config]:
    """The candidates: each tile shape without split-K, a few with split-K 2 and 4; TMA loads and pointer loads."""
    tiles = _TILES[:4] if quick else _TILES
    split_tiles = _SPLIT_TILES[:1] if quick else _SPLIT_TILES
    out: list[Config] = []
    for tma in (True, False):
        out += [(*t, 1, tma) for t in tiles]
        out += [(*t, s, tma) for t in split_tiles for s in (2, 4)]
    return out


def triton_linear(x: torch.Tensor, w: torch.Tensor, cfg: Config) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T with one configuration; graph-capturable (its workspace comes from the allocator)."""
    assert triton is not None
    bm, bn, bk, warps, stages, split, tma = cfg
    m, k = x.shape
    n = w.shape[0]
    assert x.stride(1) == 1 and w.stride(1) == 1 and w.shape[1] == k
    k_span = triton.cdiv(triton.cdiv(k, split), bk) * bk  # each split's K range, a whole number of BLOCK_K
    splits = triton.cdiv(k, k_span)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    ws = torch.empty(splits, m, n, device=x.device, dtype=torch.float32) if splits > 1 else y
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), splits)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xd = TensorDescriptor.from_tensor(x, [bm, bk])
        wd = TensorDescriptor.from_tensor(w, [bn, bk])
        _mm_tma_kernel[grid](
            xd, wd, y, ws, m, n, k, y.stride(0), k_span,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PARTIAL=splits > 1, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    else:
        _mm_ptr_kernel[grid](
            x, w, y, ws, m, n, k, x.stride(0), w.stride(0), y.stride(0), k_span,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % k_span == 0 and k_span % bk == 0,
            PARTIAL=splits > 1, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    if splits > 1:
        block = 1024
        _splitk_sum[(triton.cdiv(m * n, block),)](ws, y, m * n, SPLITS=splits, BLOCK=block, num_warps=4)
    return y


def close_enough(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """bf16 outputs agree within 1% of the reference's largest magnitude (two roundings of the same fp32 sum)."""
    err = float((out.float() - ref.float()).abs().max())
    return err <= 1e-2 * max(1.0, float(ref.float().abs().max())), err


# -- timing ----------------------------------------------------------------------------------------------------


def capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph (after two warm-up calls on a side stream) and replayed 3 times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median ms of `reps` back-to-back replays of a captured graph, each between CUDA events."""
    graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return float(statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends)))


def interleaved_ms(graphs: dict[str, torch.cuda.CUDAGraph], reps: int, rounds: int) -> dict[str, list[float]]:
    """Each graph's replay_ms once per round, the order rotated every round, so that drift of the GPU's clocks
    over the run spreads over all of them instead of favouring whichever ran at a good moment."""
    keys = list(graphs)
    out: dict[str, list[float]] = {key: [] for key in keys}
    for r in range(rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            out[key].append(replay_ms(graphs[key], reps))
    return out


def eager_ms(fn: Callable[[], None], reps: int) -> float:
    """Median ms of `reps` eager calls (host launch cost included where it exceeds the GPU's work)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return float(statistics.median(times))


# -- the variants ------------------------------------------------------------------------------------------------

Op = Callable[[str, torch.Tensor, int], torch.Tensor]  # (projection, x, weight set) -> y


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextlib.contextmanager
def blas_library(name: str) -> Iterator[None]:
    prev = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(prev)


@contextlib.contextmanager
def tunable_lookup() -> Iterator[None]:
    """TunableOp on, tuning off: calls use the results tuned earlier in this process (capturable)."""
    t = torch.cuda.tunable
    was = t.is_enabled(), t.tuning_is_enabled()
    t.enable(True)
    t.tuning_enable(False)
    try:
        yield
    finally:
        t.tuning_enable(was[1])
        t.enable(was[0])


class Variant:
    def __init__(self, name: str, op: Op, ctx: Callable[[], contextlib.AbstractContextManager[None]] = _nothing):
        self.name, self.op, self.ctx = name, op, ctx

    def __call__(self, proj: str, x: torch.Tensor, i: int) -> torch.Tensor:
        with self.ctx():
            return self.op(proj, x, i)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=list(SHAPES), default="8b", help="whose projections and layer count")
    p.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)), help="token counts M, comma-separated")
    p.add_argument("--reps", type=int, default=10, help="timed graph replays per measurement (at least 10)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; each variant's ms is their median")
    p.add_argument("--quick", action="store_true", help="fewer Triton candidates")
    p.add_argument("--skip-triton", action="store_true")
    p.add_argument("--variants", default=",".join(VARIANTS), help="which variants to time (default always is)")
    p.add_argument("--tag", default="", help="a word added to the JSON's name, for a run of a subset")
    p.add_argument("--note", default="", help="free text kept in the JSON's notes")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    try:
        ms_list = [int(v) for v in args.ms.split(",")]
    except ValueError:
        p.error(f"--ms must be comma-separated integers, not {args.ms!r}")
    if not ms_list or any(m < 1 or m > 8192 for m in ms_list):
        p.error(f"--ms values must be between 1 and 8192, not {args.ms!r}")
    if args.reps < 10:
        p.error(f"--reps must be at least 10, not {args.reps}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, not {args.rounds}")
    chosen = ["default"] + [v for v in args.variants.split(",") if v and v != "default"]
    if unknown := [v for v in chosen if v not in VARIANTS]:
        p.error(f"--variants: unknown {','.join(unknown)}; known: {','.join(VARIANTS)}")
    if args.tag and not args.tag.replace("-", "").isalnum():
        p.error(f"--tag must be letters, digits and '-', not {args.tag!r}")
    if not torch.cuda.is_available():
        print("benchmarks.gemm_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    use_triton = triton is not None and not args.skip_triton and bool({"triton", "triton_o_down"} & set(chosen))

    t_start = time.perf_counter()
    projs, layers = SHAPES[args.shape].projections, SHAPES[args.shape].layers
    dev, dt_ = torch.device("cuda"), torch.bfloat16
    matmul = matmul_rate(dev, 8192, dt_)
    copy = copy_bandwidth(dev, 2 << 30)
    torch.manual_seed(0)
    weights = [
        {name: torch.randn(n, k, device=dev, dtype=dt_) * 0.02 for name, (k, n) in projs.items()}
        for _ in range(WEIGHT_SETS)
    ]
    transposed = [{name: w.t().contiguous() for name, w in ws.items()} for ws in weights]
    wbytes = SHAPES[args.shape].weight_bytes

    t = torch.cuda.tunable
    tunable_api = {
        f: hasattr(t, f)
        for f in ("enable", "tuning_enable", "set_max_tuning_iterations", "write_file_on_exit", "get_results")
    }
    blas_default = str(torch.backends.cuda.preferred_blas_library())

    def linear(proj: str, x: torch.Tensor, i: int) -> torch.Tensor:
        return F.linear(x, weights[i][proj])

    def pretransposed(proj: str, x: torch.Tensor, i: int) -> torch.Tensor:
        return torch.mm(x, transposed[i][proj])

    def gate_up_split(parts: int) -> Op:
        def op(proj: str, x: torch.Tensor, i: int) -> torch.Tensor:
            w = weights[i][proj]
            if proj != "gate_up":
                return F.linear(x, w)
            rows = w.shape[0] // parts
            outs = [F.linear(x, w[j * rows : (j + 1) * rows]) for j in range(parts)]
            return outs[0]  # the engine's activation reads the parts as they are

        return op

    def mixed(parts: dict[str, Variant]) -> Op:  # these projections by the variants given, the rest by default
        def op(proj: str, x: torch.Tensor, i: int) -> torch.Tensor:
            return parts[proj](proj, x, i) if proj in parts else F.linear(x, weights[i][proj])

        return op

    variants: dict[str, Variant] = {
        "default": Variant("default", linear),
        "cublas": Variant("cublas", linear, lambda: blas_library("cublas")),
        "cublaslt": Variant("cublaslt", linear, lambda: blas_library("cublaslt")),
        "pretransposed": Variant("pretransposed", pretransposed),
        "gate_up_split2": Variant("gate_up_split2", gate_up_split(2)),
        "gate_up_split4": Variant("gate_up_split4", gate_up_split(4)),
    }
    variants["cublaslt_down"] = Variant("cublaslt_down", mixed({"down": variants["cublaslt"]}))
    tunable_ok = "tunableop" in chosen and all(
        tunable_api[f] for f in ("enable", "tuning_enable", "set_max_tuning_iterations")
    )
    if tunable_ok:
        variants["tunableop"] = Variant("tunableop", linear, tunable_lookup)

    tuned: dict[tuple[int, str], Config] = {}  # the Triton configuration chosen per (M, projection)

    def triton_op(m: int) -> Op:
        def op(proj: str, x: torch.Tensor, i: int) -> torch.Tensor:
            return triton_linear(x, weights[i][proj], tuned[(m, proj)])

        return op

    xs = {k: torch.randn(max(ms_list), k, device=dev, dtype=dt_) for k in dict.fromkeys(k for k, _ in projs.values())}

    # TunableOp: tune every shape once, eagerly, before anything is captured
    tunable_info: dict[str, Any] = dict(api=tunable_api, enabled=tunable_ok)
    if tunable_ok:
        tmp = tempfile.mkdtemp(prefix="gemm-probe-tunableop-")
        if hasattr(t, "set_filename"):
            t.set_filename(f"{tmp}/results.csv")  # the file is neither read nor meant to be written here
        if hasattr(t, "write_file_on_exit"):
            t.write_file_on_exit(False)
        t.enable(True)
        t.tuning_enable(True)
        t.set_max_tuning_iterations(30)
        t0 = time.perf_counter()
        for m in ms_list:
            for name, (k, _) in projs.items():
                F.linear(xs[k][:m], weights[0][name])
        torch.cuda.synchronize()
        t.tuning_enable(False)
        t.enable(False)
        results = [list(map(str, r)) for r in t.get_results()] if hasattr(t, "get_results") else []
        tunable_info.update(
            tune_s=round(time.perf_counter() - t0, 2),
            results=results,
            picked_other_than_default=any(r[2] != "Default" for r in results if len(r) > 2),
        )
        print("tunableop", tunable_info)

    # Triton: tune each (M, projection) over the candidates, keeping only those that match F.linear
    triton_info: dict[str, Any] = dict(enabled=use_triton)
    if use_triton:
        from triton.testing import do_bench

        configs = triton_configs(args.quick)
        failed: dict[str, str] = {}
        per_shape: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        for m in ms_list:
            for name, (k, _) in projs.items():
                x, w = xs[k][:m], weights[0][name]
                ref = F.linear(x, w)
                cublas_us = do_bench(lambda: F.linear(x, w), warmup=5, rep=25, return_mode="median") * 1e3
                best: tuple[float, Config, float] | None = None
                timings = {}
                for cfg in configs:
                    if str(cfg) in failed:
                        continue
                    try:
                        ok, err = close_enough(triton_linear(x, w, cfg), ref)
                        if not ok:
                            failed[str(cfg)] = f"max abs err {err:.4g} at M={m} {name}"
                            continue
                        us = do_bench(lambda: triton_linear(x, w, cfg), warmup=5, rep=25, return_mode="median") * 1e3
                    except Exception as e:  # noqa: BLE001 - a candidate that does not compile or run is dropped
                        failed[str(cfg)] = f"{type(e).__name__}: {str(e)[:200]}"
                        continue
                    timings[str(cfg)] = round(us, 2)
                    if best is None or us < best[0]:
                        best = (us, cfg, err)
                if best is None:
                    raise RuntimeError(f"no Triton configuration ran for M={m} {name}: {failed}")
                tuned[(m, name)] = best[1]
                row = dict(
                    m=m,
                    projection=name,
                    config=list(best[1]),
                    triton_us=round(best[0], 2),
                    cublas_us=round(cublas_us, 2),
                    max_abs_err=round(best[2], 5),
                    candidates_us=timings,
                )
                per_shape.append(row)
                print({key: v for key, v in row.items() if key != "candidates_us"})
            tv = variants[f"triton@{m}"] = Variant("triton", triton_op(m))
            variants[f"triton_o_down@{m}"] = Variant("triton_o_down", mixed({"o": tv, "down": tv}))
        triton_info.update(
            version=triton.__version__,
            config_fields=["BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "split_k", "tma"],
            candidates=len(configs),
            tune_s=round(time.perf_counter() - t0, 1),
            failed_candidates=failed,
            per_shape=per_shape,
            timing="do_bench median, L2 flushed before each call, eager launches",
        )

    def step(m: int, pick: dict[str, Variant]) -> Callable[[], None]:
        def run() -> None:
            for layer in range(layers):
                for name, (k, _) in projs.items():
                    pick[name](name, xs[k][:m], layer % WEIGHT_SETS)

        return run

    def one_projection(m: int, name: str, v: Variant) -> Callable[[], None]:
        k = projs[name][0]

        def run() -> None:
            for layer in range(layers):
                v(name, xs[k][:m], layer % WEIGHT_SETS)

        return run

    rows: list[dict[str, Any]] = []
    winners: list[dict[str, Any]] = []
    default = variants["default"]
    # variants that run the default's very kernels: their spread is the measurement's noise
    controls = ["default"] + (["cublas"] if "Cublas" in blas_default and "cublas" in chosen else [])
    controls += ["tunableop"] if tunable_ok and not tunable_info.get("picked_other_than_default") else []
    for m in ms_list:
        flops = layers * sum(2 * m * k * n for k, n in projs.values())
        bound = max(flops / matmul, wbytes / copy) * 1e3
        keys = [f"{v}@{m}" if f"{v}@{m}" in variants else v for v in chosen]
        keys = [key for key in keys if key in variants]
        by_name: dict[str, dict[str, Any]] = {}

        def record(label: str, rounds_ms: list[float], **extra: Any) -> dict[str, Any]:
            ms = statistics.median(rounds_ms)
            row = dict(
                m=m,
                variant=label,
                ms=round(ms, 4),
                tflops=round(flops / ms / 1e9, 1),
                bound_ms=round(bound, 3),
                fraction_of_bound=round(bound / ms, 3),
                rounds_ms=[round(v, 4) for v in rounds_ms],
                spread_pct=round(100 * (max(rounds_ms) - min(rounds_ms)) / ms, 2),
                **extra,
            )
            rows.append(row)
            by_name[label] = row
            print({key: v for key, v in row.items() if key != "rounds_ms"})
            return row

        eager = eager_ms(step(m, dict.fromkeys(projs, default)), args.reps)
        record("default_eager", [eager], note="eager launches, one measurement")
        graphs: dict[str, torch.cuda.CUDAGraph] = {}
        errs: dict[str, dict[str, float]] = {}
        for key in keys:
            v = variants[key]
            try:
                errs[v.name] = {}
                for name, (k, _) in projs.items():
                    ref = F.linear(xs[k][:m], weights[1][name])
                    got = v(name, xs[k][:m], 1)
                    if got.shape != ref.shape:  # a split variant returns its first part
                        ref = ref[:, : got.shape[1]]
                    errs[v.name][name] = round(close_enough(got, ref)[1], 5)
                graphs[f"{v.name}/step"] = capture(step(m, dict.fromkeys(projs, v)))
                for name in projs:
                    graphs[f"{v.name}/{name}"] = capture(one_projection(m, name, v))
            except Exception as e:  # noqa: BLE001 - one variant failing leaves the others' numbers
                torch.cuda.synchronize()
                for name in ["step", *projs]:
                    graphs.pop(f"{v.name}/{name}", None)
                rows.append(dict(m=m, variant=v.name, error=f"{type(e).__name__}: {str(e)[:300]}"))
                print(rows[-1])
        times = interleaved_ms(graphs, args.reps, args.rounds)
        graphs.clear()
        labels = [variants[key].name for key in keys if f"{variants[key].name}/step" in times]
        for label in labels:
            per = {name: round(statistics.median(times[f"{label}/{name}"]), 4) for name in projs}
            record(label, times[f"{label}/step"], per_projection_ms=per, max_abs_err=errs[label])

        # per projection the fastest variant at this M, captured together as one step, against default again
        pick_names = {name: min(labels, key=lambda lb: by_name[lb]["per_projection_ms"][name]) for name in projs}
        lookup = {variants[key].name: variants[key] for key in keys}
        try:
            pair = {
                "best_per_projection": capture(step(m, {name: lookup[vn] for name, vn in pick_names.items()})),
                "default_paired": capture(step(m, dict.fromkeys(projs, default))),
            }
            times = interleaved_ms(pair, args.reps, args.rounds)
            pair.clear()
            record("best_per_projection", times["best_per_projection"], picks=pick_names)
            record("default_paired", times["default_paired"], note="default, interleaved with best_per_projection")
        except Exception as e:  # noqa: BLE001
            torch.cuda.synchronize()
            rows.append(dict(m=m, variant="best_per_projection", error=f"{type(e).__name__}: {str(e)[:300]}"))
        torch.cuda.empty_cache()

        base = by_name["default"]["ms"]
        ctl = [by_name[c]["ms"] for c in controls if c in by_name]
        contenders = [r for key, r in by_name.items() if key not in ("default", "default_paired", "default_eager")]
        win = min(contenders, key=lambda r: r["ms"])
        if win["variant"] == "best_per_projection":
            base = by_name["default_paired"]["ms"]  # the gain against the default timed alongside it
        winners.append(
            dict(
                m=m,
                default_ms=base,
                best=win["variant"],
                best_ms=win["ms"],
                gain_pct=round(100 * (base / win["ms"] - 1), 2),
                same_kernel_spread_pct=round(100 * (max(ctl) / min(ctl) - 1), 2),
                same_kernel_variants=[c for c in controls if c in by_name],
            )
        )
        print(winners[-1])

    name = torch.cuda.get_device_name()
    result = dict(
        gpu=name,
        date=dt.date.today().isoformat(),
        command="python -m benchmarks.gemm_probe " + " ".join(sys.argv[1:] if argv is None else argv),
        shape=args.shape,
        layers=layers,
        torch=torch.__version__,
        blas_default=blas_default,
        matmul_TFLOPs=round(matmul / 1e12, 1),
        copy_TBps=round(copy / 1e12, 3),
        weight_GB=round(wbytes / 1e9, 3),
        timing=f"each variant's step (and each projection alone) captured once in a CUDA graph; per round the median "
        f"of {args.reps} back-to-back replays; {args.rounds} rounds, variants interleaved in rotated order; ms is "
        "the median over rounds (default_eager: eager launches, one measurement)",
        projections={name: dict(K=k, N=n) for name, (k, n) in projs.items()},
        winners=winners,
        rows=rows,
        tunableop=tunable_info,
        triton=triton_info,
        wall_s=round(time.perf_counter() - t_start, 1),
    )
    if args.note:
        result["notes"] = args.note
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "".join(f"-{w}" for w in (args.shape if args.shape != "8b" else "", args.tag) if w)
    path = args.out / f"gemm-probe-{gpu_slug(name)}{tag}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'M':>5} " + " ".join(f"{r['variant'][:14]:>14}" for r in rows if r["m"] == ms_list[0]))
    for m in ms_list:
        print(f"{m:>5} " + " ".join(f"{r.get('ms', float('nan')):>14.3f}" for r in rows if r["m"] == m))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
