"""Issue 39: where a quantized engine's large-batch time goes, kernel by kernel, against bf16's (one GPU).

    python -m benchmarks.quant_profile --out DIR [--configs bf16 fp8_weights awq] [--micro]   # one GPU
    python -m benchmarks.quant_profile --seqs 1 --configs fp8_weights bf16 --tag=-b1 --out DIR  # batch-1 decode
    python -m benchmarks.quant_profile --quick --out DIR                                      # CPU dry run

Per engine configuration (benchmarks/quantization.py's CONFIGS: the Llama-3-8B shape, random weights), the
throughput workload's prompts (256 x 512 tokens) run once for warm-up and once with the engine runner's launch
wrapped: the run's first step (a prefill chunk of max_num_batched_tokens tokens, eager) and its third decode step
of all 256 sequences (a CUDA graph replay) run under torch's profiler, CUDA activity only.  Each profiled step:
its span (first kernel's start to the last one's end), the sum of its kernels, and its kernels summed by name
(`kernels`: calls and ms) and by kind (`by_kind`, `KINDS` below: the GEMMs, FP8 activation quantization, AWQ
dequantization, the quantized products of Triton, attention, norms, dtype conversions and copies, ...).  On the
GPU also `order` (`in_order`): the idle time before each kernel summed by the kind of the kernel that follows,
and the Triton quantized products by projection (qkv, o, gate_up, down in launch order); and `floors_ms`
(`floors`): each part's weight read at the run's copy bandwidth.  --seqs N profiles N prompts instead of 256 (so a
decode step of N sequences: 1 for batch-1 decode); --tag suffixes the file name.

--micro adds the products at the step's row counts (256 and the prefill chunk) per projection of the 8B, timed
alone (benchmarks/kernels.py's `_bench`: one CUDA graph replay after an L2 flush, median): bf16 / fp16 F.linear,
the FP8 activation quantization, `_scaled_mm` row-wise (with and without fast accumulation) and per-tensor, the
AWQ dequantize + cuBLAS path and the in-register kernel (kernels/w4a16.py) at a few tiles; each with its relative
error against the float32 product of the dequantized weight.

The CPU dry run profiles the embedded model (float32, 8 prompts x 16 tokens, CPU operators by name) and a tiny
--micro, to check every code path and the JSON.  Writes DIR/quant-profile-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.quantization import CONFIGS, RESULTS, awq_model_dir
from benchmarks.step_kernels import classify

# (kind, substrings of the lower-cased kernel name): the first match wins, so the quantization kernels come
# before "gemm" (the AWQ Triton kernels' names hold it) and the GEMMs before "copy".
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fp8_act_quant", ("_quant_rows", "_quant_tile", "quantize_per_token", "quant_act")),
    ("awq_dequant", ("_awq_dequant",)),
    ("quant_triton_gemm", ("_w4a16", "_awq_gemm", "_awq_gemv", "_fp8_gemv", "_w8a16", "awq_gemv", "fp8_gemv")),
    ("decode_attention", ("_decode_kernel", "_decode_reduce")),
    ("splitk_reduce", ("reduce_splits", "_reduce_kernel", "_sum_splits")),
    ("prefill_attention", ("_prefill_kernel",)),
    ("dense_attention", ("cudnn", "fmha", "flash", "sdpa", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce", "sm90_", "sm80_", "f8f8bf16", "matmul")),
    ("kv_write", ("_write_kv",)),
    ("norm", ("rms_norm", "_norm_kernel")),
    ("silu_mul", ("silu",)),
    ("rotary", ("rotary", "rope")),
    ("sampling", ("argmax", "softmax", "sample", "topk", "sort", "multinomial", "exponential", "logit")),
    ("convert_copy", ("memcpy", "memset", "copy", "fill", "cat", "elementwise", "_to_copy", "gather", "index")),
)


def kind_of(name: str) -> str:
    return classify(name, KINDS)


def summarise(events: Iterable[tuple[str, float]], span_ms: float, top: int = 30) -> dict[str, Any]:
    """One profiled step from its (kernel name, ms) events: span, kernel sum, by kind and by name (calls, ms)."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, ms in events:
        row = by_name[name]
        row[0] += 1
        row[1] += ms
    by_kind: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "ms": 0.0})
    for name, (calls, ms) in by_name.items():
        k = by_kind[kind_of(name)]
        k["calls"] += calls
        k["ms"] += ms
    total = sum(ms for _, ms in by_name.values())
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {
        "span_ms": round(span_ms, 4),
        "kernel_sum_ms": round(total, 4),
        "gaps_ms": round(max(0.0, span_ms - total), 4),
        "by_kind": {
            k: {"calls": int(v["calls"]), "ms": round(v["ms"], 4)}
            for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]["ms"])
        },
        "kernels": [
            {"name": n[:200], "kind": kind_of(n), "calls": int(c), "ms": round(ms, 4)} for n, (c, ms) in kernels[:top]
        ],
        "kernels_left_out": max(0, len(kernels) - top),
    }


# A decoder layer's quantized products in the order the model launches them (the GEMV kernels of a decode step,
# counted in launch order, take these names in turn).
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def in_order(timed: list[tuple[float, float, str]]) -> dict[str, Any]:
    """A step's kernels in launch order ((start ms, end ms, name), one stream): the idle time before each kernel,
    summed by the kind of the kernel that follows (`gap_before_ms`), the number of kernels, and the quantized
    products (kind `quant_triton_gemm`) by projection (PROJECTIONS in turn: calls, ms, and gap before each)."""
    gaps: dict[str, float] = defaultdict(float)
    proj: dict[str, dict[str, float]] = {p: {"calls": 0, "ms": 0.0, "gap_before_ms": 0.0} for p in PROJECTIONS}
    q = 0
    for i, (start, end, name) in enumerate(timed):
        gap = max(0.0, start - timed[i - 1][1]) if i else 0.0
        kind = kind_of(name)
        gaps[kind] += gap
        if kind == "quant_triton_gemm":
            row = proj[PROJECTIONS[q % len(PROJECTIONS)]]
            row["calls"] += 1
            row["ms"] += end - start
            row["gap_before_ms"] += gap
            q += 1
    return {
        "kernels": len(timed),
        "gap_before_ms": {k: round(v, 4) for k, v in sorted(gaps.items(), key=lambda kv: -kv[1])},
        "quant_products": {p: {k: round(v, 4) for k, v in row.items()} for p, row in proj.items()} if q else {},
    }


def floors(shape: dict[str, Any], copy_Bps: float, seqs: int, context: int) -> dict[str, float]:
    """ms to read each part of a decode step's weights once at `copy_Bps` (FP8: one byte a weight and a float32
    scale per output row; bf16 two bytes), and the attention's KV read (bf16) at `context` tokens per sequence."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    dims = {"qkv_proj": (h, h + 2 * kv), "o_proj": (h, h), "gate_up_proj": (h, 2 * inter), "down_proj": (inter, h)}
    out = {f"{p}_fp8": layers * (k * n + 4 * n) / copy_Bps * 1e3 for p, (k, n) in dims.items()}
    out.update({f"{p}_bf16": layers * 2 * k * n / copy_Bps * 1e3 for p, (k, n) in dims.items()})
    out["lm_head_bf16"] = 2 * h * shape["vocab_size"] / copy_Bps * 1e3
    out["attention_kv"] = layers * seqs * context * 2 * kv * 2 / copy_Bps * 1e3
    return {k: round(v, 4) for k, v in out.items()}


def _step_kind(plan: Any) -> str:
    ones = sum(1 for s in plan.seqs if s.num_tokens == 1)
    if plan.seqs and ones == len(plan.seqs):
        return "decode"
    return "mixed" if ones else "prefill"


class StepProfiler:
    """Wraps an engine's runner.launch: profiles the first prefill step and the `decode_index`-th decode step of
    `decode_seqs` sequences (restored by close())."""

    def __init__(self, llm: Any, decode_seqs: int, decode_index: int = 3) -> None:
        self.runner = llm.llm_engine.core.runner
        self.launch = self.runner.launch
        self.cuda = torch.cuda.is_available() and llm.llm_engine.core.config.resolved_device().startswith("cuda")
        self.decode_seqs, self.decode_index = decode_seqs, decode_index
        self.decodes = 0
        self.samples: dict[str, dict[str, Any]] = {}
        self.runner.launch = self._launch

    def _launch(self, plan: Any, previous: Any = None) -> Any:
        kind = _step_kind(plan)
        if kind == "decode" and len(plan.seqs) == self.decode_seqs:
            self.decodes += 1
        want = (kind == "prefill" and "prefill" not in self.samples) or (
            kind == "decode" and self.decodes == self.decode_index and "decode" not in self.samples
        )
        if not want:
            return self.launch(plan, previous)
        sample, summary = self._profiled(plan, previous)
        summary["seqs"] = len(plan.seqs)
        summary["tokens"] = sum(s.num_tokens for s in plan.seqs)
        self.samples[kind] = summary
        return sample

    def _profiled(self, plan: Any, previous: Any) -> tuple[Any, dict[str, Any]]:
        from torch.profiler import ProfilerActivity, profile

        if self.cuda:
            torch.cuda.synchronize()  # the previous step's kernels stay out of the trace
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                sample = self.launch(plan, previous)
                torch.cuda.synchronize()
            events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            if not events:
                return sample, summarise([], 0.0)
            first = min(e.time_range.start for e in events)
            last = max(e.time_range.end for e in events)
            pairs = [(e.name, e.time_range.elapsed_us() / 1e3) for e in events]
            summary = summarise(pairs, (last - first) / 1e3)
            timed = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
            summary["order"] = in_order([(a / 1e3, b / 1e3, n) for a, b, n in timed])
            return sample, summary
        t = time.perf_counter()  # the CPU dry run: operators by name, their self time
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            sample = self.launch(plan, previous)
        span = (time.perf_counter() - t) * 1e3
        pairs = [
            (e.key, e.self_cpu_time_total / 1e3 / max(1, e.count)) for e in prof.key_averages() for _ in range(e.count)
        ]
        return sample, summarise(pairs, span)

    def close(self) -> None:
        self.runner.launch = self.launch


BASELINE = "@baseline"  # a configuration name with this suffix runs the FP8 path as it was before 2026-11-28d


class fp8_baseline:
    """The FP8 path before 2026-11-28d for the engines built inside: the one-row quantization kernel, no fast
    accumulation (module globals read at every call)."""

    def __enter__(self) -> None:
        from kernels import fp8_linear, quant_cuda

        self.saved = fp8_linear.QUANT_KERNEL, quant_cuda.FP8_FAST_ACCUM_MAX_K
        fp8_linear.QUANT_KERNEL, quant_cuda.FP8_FAST_ACCUM_MAX_K = "row", 0

    def __exit__(self, *exc: object) -> None:
        from kernels import fp8_linear, quant_cuda

        fp8_linear.QUANT_KERNEL, quant_cuda.FP8_FAST_ACCUM_MAX_K = self.saved


def profile_engine(model: str, flags: dict[str, Any], base: dict[str, Any], work: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.throughput import _free, _sync
    from engine import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(model, **base, **flags)
    prof: StepProfiler | None = None
    try:
        inputs = [{"prompt_token_ids": p} for p in work["prompts"]]
        params = SamplingParams(temperature=0, max_tokens=work["decode_steps"], ignore_eos=True)
        if work["warmup"]:  # every Triton variant compiled, the graphs captured
            llm.generate(inputs, params, use_tqdm=False)
        _sync()
        prof = StepProfiler(llm, len(inputs), work["decode_index"])
        try:
            llm.generate(inputs, params, use_tqdm=False)
        finally:
            prof.close()
        row: dict[str, Any] = {"flags": flags, **prof.samples, "seconds": round(time.monotonic() - started, 1)}
        prof = None  # it holds the runner: the engine's memory goes with the engine
        for step in ("prefill", "decode"):
            if step in row:
                s = row[step]
                kinds = ", ".join(f"{k} {v['ms']:.3f}" for k, v in list(s["by_kind"].items())[:6])
                print(
                    f"  {step} ({s['tokens']} tokens): span {s['span_ms']:.3f} ms, kernels {s['kernel_sum_ms']:.3f}:",
                    kinds,
                )
        return row
    finally:
        prof = None
        llm.close()
        del llm
        _free()


# -- the products alone (--micro) ------------------------------------------------------------------------------

SHAPES = {"qkv_proj": (4096, 6144), "o_proj": (4096, 4096), "gate_up_proj": (4096, 28672), "down_proj": (14336, 4096)}
QUICK_SHAPES = {"qkv_proj": (128, 64)}
GROUP = 128
# kernels/w4a16.py tiles tried at the large row counts: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP_AB)
W4A16_TILES = [(128, 128, 64, 8, 3, False)]  # the default from 96 rows (2026-11-28's sweep: none of 8 tiles was
# within 2x of dequantize + cuBLAS at 256 or 8192 rows)
# kernels/awq_gemm.py's dequantization tiles: (BLOCK_K, BLOCK_N, num_warps)
DEQUANT_TILES = [(32, 128, 4), (64, 128, 4), (128, 128, 8), (32, 256, 4), (64, 256, 8), (128, 256, 8), (128, 64, 4)]
# kernels/fp8_linear.py's tile quantization kernel: (ROWS, BLOCK, num_warps); a BLOCK of at least K is one pass
QUANT_TILES = [
    (1, 1024, 4),
    (1, 2048, 4),
    (1, 4096, 4),
    (1, 4096, 8),
    (1, 16384, 8),
    (2, 1024, 4),
    (2, 2048, 8),
    (4, 512, 4),
    (4, 1024, 4),
    (4, 1024, 8),
    (8, 512, 8),
    (4, 4096, 8),
]
QUICK_W4A16_TILES = [(64, 32, 32, 4, 1, False), (64, 32, 32, 4, 1, True)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return round(float((got.float() - want).norm() / want.norm()), 5)


def micro(rows: tuple[int, ...], quick: bool, sweeps: bool = False) -> list[dict[str, Any]]:
    """Each arm's ms (and relative error where it computes the product); `sweeps`: the tiles of the FP8
    quantization and the AWQ dequantization kernels at the first row count too (`rows` is one list for all)."""
    import torch.nn.functional as F
    import triton

    from engine.model.quantize import awq_quantize
    from kernels import fp8_linear as f8
    from kernels import quant_cuda as qc
    from kernels import quant_reference as qr
    from kernels.awq_gemm import awq_dequantize, awq_gemm
    from kernels.w4a16 import w4a16_linear

    device = torch.device("cuda" if not quick else "cpu")
    if quick:

        def timer(fn: Callable[[], Any]) -> float:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3

    else:
        from benchmarks.kernels import _bench as timer
    out = []
    g = torch.Generator(device=device).manual_seed(0)
    for layer, (k, n) in (QUICK_SHAPES if quick else SHAPES).items():
        w = torch.randn(n, k, generator=g, device=device, dtype=torch.float32) * 0.02
        w8, ws = qr.quantize_rows(w)
        awq = awq_quantize(w.half() if not quick else w, GROUP)
        w_awq = qr.awq_dequantize(awq["qweight"], awq["qzeros"], awq["scales"], GROUP).float()  # [k, n]
        wb = w.to(torch.bfloat16 if not quick else torch.float32)
        wh = w_awq.t().contiguous().to(torch.float16 if not quick else torch.float32)
        for m in rows:
            x = torch.randn(m, k, generator=g, device=device, dtype=torch.float32)
            xb, xh = (x, x) if quick else (x.bfloat16(), x.half())
            want8 = xb.float() @ (w8.float() * ws[:, None]).t()
            want4 = xh.float() @ w_awq
            row: dict[str, Any] = {"layer": layer, "K": k, "N": n, "M": m}
            arms: dict[str, tuple[Callable[[], Any], torch.Tensor | None]] = {
                "bf16": (lambda: F.linear(xb, wb), None),
                "fp16": (lambda: F.linear(xh, wh), None),
                "fp8_act_quant": (lambda: f8.quantize_per_token(xb), None),
                "awq_dequantize_cublas": (
                    lambda: awq_gemm(xh, awq["qweight"], awq["qzeros"], awq["scales"], GROUP, dense=True),
                    want4,
                ),
                "awq_default": (lambda: qc.awq_linear(xh, awq["qweight"], awq["qzeros"], awq["scales"], GROUP), want4),
                "awq_dequant_only": (
                    lambda: awq_dequantize(awq["qweight"], awq["qzeros"], awq["scales"], GROUP, xh.dtype),
                    None,
                ),
            }
            if sweeps and m == rows[0]:
                for bk, bn, warps in DEQUANT_TILES[:1] if quick else DEQUANT_TILES:
                    arms[f"awq_dequant_{bk}x{bn}_w{warps}"] = (
                        partial(
                            awq_dequantize,
                            awq["qweight"],
                            awq["qzeros"],
                            awq["scales"],
                            GROUP,
                            xh.dtype,
                            config=dict(BLOCK_K=bk, BLOCK_N=bn, num_warps=warps),
                        ),
                        None,
                    )
            if sweeps:
                for tile in QUANT_TILES[:2] if quick else QUANT_TILES:
                    r, blk, warps = tile
                    arms[f"fp8_act_quant_r{r}_b{blk}_w{warps}"] = (
                        partial(f8.quantize_per_token, xb, config=dict(ROWS=r, BLOCK=blk, num_warps=warps)),
                        None,
                    )
                arms["fp8_act_quant_row_kernel"] = (
                    lambda: f8.quantize_per_token(xb, block=triton.next_power_of_2(min(k, 16384))),
                    None,
                )
            if not quick:
                xq, xs = f8.quantize_per_token(xb)
                one = torch.ones((), device=device)
                arms["fp8_scaled_mm_default"] = (lambda: qc.scaled_mm(xq, xs, w8, ws, torch.bfloat16), want8)
                arms["fp8_scaled_mm_rowwise"] = (
                    lambda: torch._scaled_mm(
                        xq, w8.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16, use_fast_accum=False
                    ),
                    want8,
                )
                arms["fp8_scaled_mm_rowwise_fast_accum"] = (
                    lambda: torch._scaled_mm(
                        xq, w8.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16, use_fast_accum=True
                    ),
                    want8,
                )
                arms["fp8_scaled_mm_tensorwise"] = (
                    lambda: torch._scaled_mm(xq, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                    None,
                )
                arms["fp8_default"] = (lambda: qc.fp8_linear(xb, w8, ws), want8)
            tiles = QUICK_W4A16_TILES if quick else W4A16_TILES
            for bm, bn, bk, warps, stages, swap in tiles:
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, SWAP_AB=swap)
                arms[f"w4a16_{bm}x{bn}x{bk}_w{warps}_s{stages}{'_swap' if swap else ''}"] = (
                    partial(
                        w4a16_linear, xh, awq["qweight"], awq["qzeros"], awq["scales"], GROUP, config=cfg, splits=1
                    ),
                    want4,
                )
            for name, (fn, want) in arms.items():
                try:
                    got = fn()
                    if want is not None:
                        row[f"{name}_rel_err"] = _rel(got, want)
                    row[f"{name}_ms"] = round(timer(fn), 5)
                except Exception as e:  # noqa: BLE001 - a tile that does not fit or a refused mode: say so
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
            out.append(row)
            print(
                f"  {layer} M={m}: "
                + ", ".join(f"{k[:-3]} {v:.4f}" for k, v in row.items() if k.endswith("_ms") and isinstance(v, float))
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU dry run on the embedded model")
    p.add_argument("--configs", nargs="*", default=["bf16", "fp8_weights", "awq"])
    p.add_argument("--micro", action="store_true", help="the products alone at the profiled row counts")
    p.add_argument("--micro-only", action="store_true", help="only --micro (no engines)")
    p.add_argument("--sweeps", action="store_true", help="with --micro: the quantization and dequantization tiles")
    p.add_argument("--seqs", type=int, default=256, help="prompts, so the profiled decode step's sequences")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.quick
    if not gpu and not args.quick:
        print("error: no CUDA device; use --quick for the CPU dry run", file=sys.stderr)
        return 2
    from benchmarks.kernels import device_slug
    from benchmarks.memory import LLAMA3_8B, model_dir
    from benchmarks.throughput import prompts_for

    base_model = model_dir(quick=not gpu)
    if args.quick:  # a private copy: the AWQ checkpoint is written beside it
        import shutil
        import tempfile

        private = Path(tempfile.mkdtemp(prefix="pagekeeper-qprof-")) / "model"
        shutil.copytree(base_model, private, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
        base_model = str(private)
    cfg: dict[str, Any] = LLAMA3_8B if gpu else json.loads((Path(base_model) / "config.json").read_text())
    num, in_len = (args.seqs, 512) if gpu else (min(args.seqs, 4), 16)
    chunk = 8192 if gpu else 64
    # 256 x 512 prompts prefill 16 to a step: the 256 sequences decode together from the 17th step on
    work: dict[str, Any] = {
        "prompts": prompts_for(num, in_len, int(cfg["vocab_size"]), seed=0),
        "warmup": gpu,
        "decode_steps": 24 if gpu else 4,
        "decode_index": 3 if gpu else 2,
    }
    base: dict[str, Any] = dict(
        device="cuda" if gpu else "cpu",
        max_num_seqs=256 if gpu else num,
        max_model_len=1024 if gpu else 64,
        max_num_batched_tokens=chunk,
        swap_space=0,
        gpu_memory_utilization=0.9,
    )
    if gpu:
        base["load_format"] = "dummy"
    else:
        base["kv_cache_memory_bytes"] = 8 << 20
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "date": dt.date.today().isoformat(),
        "command": "python -m benchmarks.quant_profile " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "model_shape": "LlamaForCausalLM (Llama-3-8B shape, random weights)" if gpu else "embedded model",
        "workload": {"num_prompts": num, "input_len": in_len, "max_num_batched_tokens": chunk},
        "engines": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"quant-profile-{device_slug(gpu)}-{result['date']}{args.tag}.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=2) + "\n")

    started = time.monotonic()
    if gpu:
        from benchmarks.throughput import copy_bandwidth

        copy = copy_bandwidth(torch.device("cuda"), 2 << 30)
        result["copy_TBps"] = round(copy / 1e12, 4)
        # the profiled decode step's context: the prompt and the decode steps before it
        result["floors_ms"] = floors(cfg, copy, num, in_len + work["decode_index"] + 1)
    if not args.micro_only:
        models: dict[str, str] = {"base": base_model}
        arms = [(c, *spec[1:]) for c in args.configs for spec in CONFIGS if spec[0] == c.removesuffix(BASELINE)]
        for name, flags, which in arms:
            if which not in models:
                models[which] = awq_model_dir(base_model, quick=not gpu)
            if not gpu:  # the CPU run: float32 (bf16 matmuls are slow on CPUs; AWQ's float16 too)
                flags = {**flags, "dtype": "float32"}
            print(f"{name}:")
            try:
                with fp8_baseline() if name.endswith(BASELINE) else contextlib.nullcontext():
                    result["engines"][name] = profile_engine(models[which], flags, base, work)
            except Exception as e:  # noqa: BLE001 - record why a configuration could not run, keep the rest
                result["engines"][name] = {"flags": flags, "error": f"{type(e).__name__}: {e}"[:800]}
                result["engines"][name]["traceback_tail"] = traceback.format_exc()[-2000:]
            save()
    if args.micro or args.micro_only:
        result["micro"] = micro((256, chunk) if gpu else (4,), quick=not gpu, sweeps=args.sweeps)
        save()
    result["seconds"] = round(time.monotonic() - started, 1)
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
