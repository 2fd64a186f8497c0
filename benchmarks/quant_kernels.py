"""Issue 39's per-layer kernel benchmark: every quantized-matmul path at Llama-3-8B's GEMM sizes, beside bf16.

    python -m benchmarks.quant_kernels --out DIR [--sweep-budget-s 90]   # one GPU
    python -m benchmarks.quant_kernels --quick --out DIR                 # CPU dry run (Triton's interpreter)
    python -m benchmarks.quant_kernels --decode --out DIR                # one GPU: M = 1..32, decode arms only
    python -m benchmarks.quant_kernels --tc --out DIR [--tc-budget-s 330] # one GPU: kernels/w4a16_tc.py's tiles

For each projection (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) and M = 1, 8, 32,
256, 4096 rows, the device time of one call (on CUDA: one CUDA graph of the same call on several copies of the
weights, together several times L2, run back to back and divided by their number, as a decode step runs its
layers: benchmarks/kernels.py's bench_rotating; until 2026-11-28 one call after a 256 MiB L2-flushing write) of:

- `bf16`, `fp16`: F.linear on the 16-bit weight (fp16 is AWQ's activation dtype);
- FP8 weights: `fp8_scaled_mm` (the Triton per-token quantization + torch._scaled_mm), `fp8_scaled_mm_torch_quant`
  (the previous torch-op quantization), `fp8_quantize_only`, the W8A16 kernels `fp8_w8a16_cuda_core` (M <= 8)
  and `fp8_w8a16_dot` (M <= 32), and `fp8_default` (kernels/quant_cuda.py's choice);
- AWQ: `awq_cuda_core` (M <= 8), `awq_dot` (kernels/w4a16.py's default tile) and `awq_dot_other_order` (its
  operands swapped, M <= 256), `awq_dequantize_cublas`, `awq_legacy`
  (kernels/awq_gemm.py's own dispatch) and `awq_default`;
- the bandwidth-shaped decode kernels: `fp8_gemv` (kernels/fp8_gemv.py, M <= 16) and `fp8_gemv_two_pass` (its
  splits summed by a second kernel), `awq_gemv2` (kernels/awq_gemv.py, one row per program, M <= 32);

each with its relative error against the float32 product of the dequantized weight, the bytes floor (the
weight read once, plus the activations in and out, at copy bandwidth), and for every timed path its achieved
`<path>_TBps` (its format's floor bytes over its time; compare `copy_TBps`, measured in the same run).
--decode times M = 1, 2, 4, 8, 16, 32 and only the paths a decode step can take (bf16, `fp8_scaled_mm`, the W8A16
CUDA-core kernel, `awq_legacy` (the old GEMV), `awq_dot`, the new kernels and both defaults), in about a minute.
`rule` sums the four projections (one decoder layer's linears) per M and names the fastest FP8 and AWQ path, the
boundaries kernels/quant_cuda.py should use; `layer` gives that sum for bf16, the default paths and the fastest.
With --sweep-budget-s, tile
sweeps of the W8A16 and AWQ kernels at M = 1 and 16 run until the budget is spent.  Writes
DIR/quant-kernels-<gpu>-<date>.json after every projection.

--tc times kernels/w4a16_tc.py (the tensor-core AWQ GEMM on the load-time repacked weight) at M = 8 to 256: its
default tile (`awq_tc`) and the candidate tiles of `tc_candidates` (`awq_tc[label]`), beside bf16, fp16,
`awq_dequantize_cublas`, `awq_dot`, the repacked weight dequantized for cuBLAS (`awq_tc_dense`) and the path the
engine's repacked layer takes by rows and columns (`awq_tc_routed`: quant_cuda.awq_linear), every output checked;
`tc_rule` sums the four projections per M and names the fastest tile per M and per projection; --tc-variants
times only the default tile with its WORD_PAIRS and EVEN options on and off.  Writes
DIR/quant-kernels-<gpu>-<date>-tc.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SHAPES = {"qkv_proj": (4096, 6144), "o_proj": (4096, 4096), "gate_up_proj": (4096, 28672), "down_proj": (14336, 4096)}
ROWS = (1, 8, 32, 256, 4096)
QUICK_SHAPES = {"qkv_proj": (256, 192), "down_proj": (384, 128)}
QUICK_ROWS = (1, 8, 32)
GROUP = 128
DECODE_ROWS = (1, 2, 4, 8, 16, 32)
DECODE_PATHS = (
    "bf16",
    "fp8_scaled_mm",
    "fp8_w8a16_cuda_core",
    "fp8_gemv",
    "fp8_gemv_two_pass",
    "fp8_default",
    "awq_legacy",
    "awq_dot",
    "awq_gemv2",
    "awq_default",
)
FP8_PATHS = ("fp8_w8a16_cuda_core", "fp8_w8a16_dot", "fp8_scaled_mm", "fp8_gemv", "fp8_gemv_two_pass")
# The largest relative error each kind of path may show against the float32 product of its own dequantized
# weight (W8A8 adds the activations' e4m3 rounding; the rest only round their output): past it, the row records
# the path as wrong and the run exits 1.
TOLERANCE = {"fp8_scaled_mm": 0.05, "fp8": 0.01, "awq": 0.005, "": 0.01}
AWQ_PATHS = ("awq_cuda_core", "awq_dot", "awq_dot_other_order", "awq_dequantize_cublas", "awq_legacy", "awq_gemv2")


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    if device.type == "cuda":
        from benchmarks.kernels import _bench

        return _bench

    def cpu_ms(fn: Callable[[], Any]) -> float:
        """The --quick dry run runs the kernels in Triton's interpreter, whose times say nothing of the GPU's: one
        call shows that the path runs and is timed (a warm-up and a median of three made the stage 2.5x longer)."""
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return cpu_ms


def variants(m: int, w: dict[str, torch.Tensor], x: torch.Tensor, x16: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Every path that applies at `m` rows, as a closure over this projection's tensors."""
    import torch.nn.functional as F

    from kernels import fp8_linear as f8
    from kernels import quant_cuda
    from kernels import quant_reference as qr
    from kernels.awq_gemm import awq_gemm
    from kernels.awq_gemv import awq_gemv
    from kernels.fp8_gemv import MAX_ROWS as FP8_GEMV_MAX_ROWS
    from kernels.fp8_gemv import fp8_gemv
    from kernels.w4a16 import w4a16_config, w4a16_linear

    wq, ws = w["fp8"], w["fp8_scale"]
    qw, qz, sc = w["qweight"], w["qzeros"], w["scales"]
    out: dict[str, Callable[[], Any]] = {
        "bf16": lambda: F.linear(x, w["bf16"]),
        "fp16": lambda: F.linear(x16, w["fp16"]),
        "fp8_scaled_mm": lambda: quant_cuda.scaled_mm(*f8.quantize_per_token(x), wq, ws, x.dtype),
        "fp8_scaled_mm_torch_quant": lambda: quant_cuda.scaled_mm(*qr.quantize_per_token(x), wq, ws, x.dtype),
        "fp8_quantize_only": lambda: f8.quantize_per_token(x),
        "fp8_default": lambda: quant_cuda.fp8_linear(x, wq, ws),
        "awq_dot": lambda: w4a16_linear(x16, qw, qz, sc, GROUP, use_dot=True),
        "awq_dequantize_cublas": lambda: awq_gemm(x16, qw, qz, sc, GROUP, dense=True),
        "awq_legacy": lambda: awq_gemm(x16, qw, qz, sc, GROUP),
        "awq_default": lambda: quant_cuda.awq_linear(x16, qw, qz, sc, GROUP),
    }
    if m <= 256:  # the other operand order than the default tile's (kernels/w4a16.py's w4a16_config)
        flipped = dict(SWAP_AB=not w4a16_config(m, GROUP, True)["SWAP_AB"])
        out["awq_dot_other_order"] = lambda: w4a16_linear(x16, qw, qz, sc, GROUP, use_dot=True, config=flipped)
    if m <= 32:
        out["fp8_w8a16_dot"] = lambda: f8.w8a16_linear(x, wq, ws, use_dot=True)
    if m <= 8:
        out["fp8_w8a16_cuda_core"] = lambda: f8.w8a16_linear(x, wq, ws, use_dot=False)
        out["awq_cuda_core"] = lambda: w4a16_linear(x16, qw, qz, sc, GROUP, use_dot=False)
    if m <= FP8_GEMV_MAX_ROWS:
        out["fp8_gemv"] = lambda: fp8_gemv(x, wq, ws)
        out["fp8_gemv_two_pass"] = lambda: fp8_gemv(x, wq, ws, in_kernel_sum=False)
    if m <= 32:
        out["awq_gemv2"] = lambda: awq_gemv(x16, qw, qz, sc, GROUP)
    return out


def weights(k: int, n: int, device: torch.device) -> dict[str, torch.Tensor]:
    from engine.model.quantize import awq_quantize
    from kernels import quant_reference as qr

    g = torch.Generator(device=device).manual_seed(k + n)
    w = torch.randn(n, k, generator=g, device=device, dtype=torch.float32) * 0.02
    wq, ws = qr.quantize_rows(w)
    awq = awq_quantize(w.half(), GROUP)
    return {
        "bf16": w.bfloat16(),
        "fp16": w.half(),
        "fp8": wq,
        "fp8_scale": ws,
        "fp8_dense": wq.float() * ws[:, None],  # [n, k], the reference for the FP8 paths
        "awq_dense": qr.awq_dequantize(awq["qweight"], awq["qzeros"], awq["scales"], GROUP),  # [k, n]
        "qweight": awq["qweight"],
        "qzeros": awq["qzeros"],
        "scales": awq["scales"],
    }


ROTATE_BYTES = 192 << 20  # the smallest format's copies together: several times an H100's or H200's 50-60 MB L2
COPIED = (
    "bf16",
    "fp16",
    "fp8",
    "fp8_scale",
    "qweight",
    "qzeros",
    "scales",
    "tc_packed",
    "tc_zf",
)  # what the timed kernels read


def rotations(k: int, n: int) -> int:
    """How many copies of a projection's weights the timer rotates through (at least 2)."""
    return max(2, math.ceil(ROTATE_BYTES / (k * n // 2)))  # the int4 weight is the smallest


def _copy_inputs(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: (v.clone() if key in COPIED else v) for key, v in w.items()}


def floors(k: int, n: int, m: int, copy_Bps: float) -> dict[str, float]:
    """ms to read each format's weight once and the activations in and out, at copy bandwidth."""
    bytes_by = floor_bytes(k, n, m)
    return {f"{fmt}_floor_ms": round(b / copy_Bps * 1e3, 5) for fmt, b in bytes_by.items()}


def _reference(name: str, w: dict[str, torch.Tensor], x: torch.Tensor, x16: torch.Tensor) -> torch.Tensor | None:
    if name.startswith("fp8") and name != "fp8_quantize_only":
        return x.float() @ w["fp8_dense"].t()
    if name.startswith("awq"):
        return x16.float() @ w["awq_dense"]
    if name in ("bf16", "fp16"):
        return (x if name == "bf16" else x16).float() @ w["bf16"].float().t()
    return None


def _checked(
    row: dict[str, Any], errors: dict[str, str], name: str, got: torch.Tensor, want: torch.Tensor, tol: float
) -> bool:
    """Record `name`'s relative error against `want` in `row`; over `tol`, also the error in `errors` (False)."""
    err = float((got.float() - want).norm() / want.norm())
    row[f"{name}_rel_err"] = float(f"{err:.3g}")
    if err < tol:
        return True
    errors[name] = f"wrong: relative error {err:.3g} against the reference (limit {tol})"
    return False


def _tolerance(name: str, m: int) -> float:
    from kernels import quant_cuda

    if name.startswith("fp8_scaled_mm") or (name == "fp8_default" and quant_cuda.fp8_path(m) == "scaled-mm"):
        return TOLERANCE["fp8_scaled_mm"]
    return TOLERANCE[name.split("_")[0] if name.startswith(("fp8", "awq")) else ""]


def floor_bytes(k: int, n: int, m: int) -> dict[str, int]:
    """Bytes each format's product must move: the weight (and its scales) once, the 16-bit activations in and out."""
    acts16 = 2 * m * (k + n)
    return {
        "bf16": 2 * k * n + acts16,
        "fp8": k * n + 4 * n + acts16,
        "awq": k * n // 2 + (k // GROUP) * n * 2 + (k // GROUP) * n // 2 + acts16,
    }


def _format(name: str) -> str:
    return "bf16" if name in ("bf16", "fp16") else name.split("_")[0]


def measure(
    shapes: dict[str, tuple[int, int]],
    rows: tuple[int, ...],
    device: torch.device,
    copy_Bps: float,
    save,
    only: tuple[str, ...] | None = None,
):
    bench = _timer(device)
    results: list[dict[str, Any]] = []
    # The CPU dry run (Triton's interpreter, whose times say nothing of a GPU's) shows that every path runs and is
    # checked: each path once per shape, at the first row count where it applies, timed by that checked call; the
    # bf16 baselines and the defaults at every row count, so that each row's rule has something to pick.  A 1-row
    # GEMV interpreted at 32 rows took 16 s of the 60 the stage took.
    dry_run = device.type != "cuda"
    for layer, (k, n) in shapes.items():
        ran: set[str] = set()
        w = weights(k, n, device)
        # copies of the kernels' inputs, together several times L2, timed back to back (benchmarks/kernels.py's
        # bench_rotating); the float32 references are not copied
        copies = [w] + [_copy_inputs(w) for _ in range(rotations(k, n) - 1)] if device.type == "cuda" else [w]
        for m in rows:
            gx = torch.Generator(device=device).manual_seed(m)
            x = torch.randn(m, k, generator=gx, device=device, dtype=torch.float32).bfloat16()
            x16 = x.half()
            row: dict[str, Any] = {"layer": layer, "K": k, "N": n, "M": m, **floors(k, n, m, copy_Bps)}
            errors: dict[str, str] = {}
            moved = floor_bytes(k, n, m)
            for name, fn in variants(m, w, x, x16).items():
                if only is not None and name not in only:
                    continue
                if dry_run and name in ran and name not in ("bf16", "fp16", "fp8_default", "awq_default"):
                    continue
                ran.add(name)
                try:
                    started = time.perf_counter()
                    got = fn()
                    checked_ms = (time.perf_counter() - started) * 1e3
                    want = _reference(name, w, x, x16)
                    if want is not None:
                        _checked(row, errors, name, got, want, _tolerance(name, m))
                    if len(copies) > 1:
                        from benchmarks.kernels import bench_rotating

                        fns = [fn] + [variants(m, c, x, x16)[name] for c in copies[1:]]
                        row[f"{name}_ms"] = round(bench_rotating(fns), 5)
                    elif dry_run:
                        row[f"{name}_ms"] = round(checked_ms, 5)
                    else:
                        row[f"{name}_ms"] = round(bench(fn), 5)
                    if name != "fp8_quantize_only" and row[f"{name}_ms"] > 0:
                        row[f"{name}_TBps"] = round(moved[_format(name)] / (row[f"{name}_ms"] * 1e-3) / 1e12, 3)
                except Exception as e:  # noqa: BLE001 - one path that fails to compile or run: record it, keep going
                    errors[name] = f"{type(e).__name__}: {e}"[:400]
                    traceback.print_exc()
            for fmt, paths in (("fp8", FP8_PATHS), ("awq", AWQ_PATHS)):
                timed = {p: row[f"{p}_ms"] for p in paths if f"{p}_ms" in row}
                if timed:
                    best = min(timed, key=lambda p: timed[p])
                    row[f"{fmt}_best"] = best
                    row[f"{fmt}_best_over_floor"] = round(timed[best] / row[f"{fmt}_floor_ms"], 3)
            if "bf16_ms" in row:
                row["bf16_over_floor"] = round(row["bf16_ms"] / row["bf16_floor_ms"], 3)
            if errors:
                row["errors"] = errors
            results.append(row)
            print(
                f"{layer} M={m}: bf16 {row.get('bf16_ms')} ms (floor {row['bf16_floor_ms']}); "
                f"fp8 default {row.get('fp8_default_ms')} best {row.get('fp8_best')} (floor {row['fp8_floor_ms']}); "
                f"awq default {row.get('awq_default_ms')} best {row.get('awq_best')} (floor {row['awq_floor_ms']})"
                + (f"; errors in {sorted(errors)}" if errors else ""),
                flush=True,
            )
        del w, copies
        save(results)
    return results


def rule(results: list[dict[str, Any]], rows: tuple[int, ...], layers: int) -> dict[str, Any]:
    """Per M, one decoder layer's four projections summed: every path's total, the fastest FP8 and AWQ path."""
    out: dict[str, Any] = {}
    for m in rows:
        at_m = [r for r in results if r["M"] == m]
        if len(at_m) != layers:
            continue
        totals: dict[str, float] = {}
        for key in at_m[0]:
            if key.endswith("_ms") and all(key in r for r in at_m):
                totals[key.removesuffix("_ms")] = round(sum(r[key] for r in at_m), 5)
        entry: dict[str, Any] = {"layer_ms": totals}
        # the layer's bytes over the layer's time, per path (the four projections' floors are bytes at copy rate)
        entry["layer_TBps"] = {
            p: round(sum(floor_bytes(r["K"], r["N"], m)[_format(p)] for r in at_m) / (t * 1e9), 3)
            for p, t in totals.items()
            if not p.endswith("_floor") and p != "fp8_quantize_only" and t > 0
        }
        for fmt, paths in (("fp8", FP8_PATHS), ("awq", AWQ_PATHS)):
            timed = {p: totals[p] for p in paths if p in totals}
            if timed:
                entry[f"{fmt}_fastest"] = min(timed, key=lambda p: timed[p])
        for name in ("fp8_default", "awq_default"):
            if name in totals and "bf16" in totals:
                entry[f"{name}_speedup_over_bf16"] = round(totals["bf16"] / totals[name], 3)
            floor = totals.get(f"{name.split('_')[0]}_floor")
            if name in totals and floor:
                entry[f"{name}_over_floor"] = round(totals[name] / floor, 3)
        out[str(m)] = entry
    return out


def _sweep_fn(kernel: str, w: dict[str, torch.Tensor], x: torch.Tensor, cfg: dict[str, Any]) -> Callable[[], Any]:
    from kernels import fp8_linear as f8
    from kernels.w4a16 import w4a16_linear

    if kernel.startswith("fp8"):
        return lambda: f8.w8a16_linear(x, w["fp8"], w["fp8_scale"], use_dot=kernel == "fp8_dot", config=cfg)
    x16 = x.half()
    return lambda: w4a16_linear(
        x16, w["qweight"], w["qzeros"], w["scales"], GROUP, use_dot=kernel == "awq_dot", config=cfg
    )


SWEEP = {  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP_AB) per kernel
    "fp8_cuda_core": [
        (1, 16, 256, 4, 3, None),
        (1, 8, 512, 4, 4, None),
        (1, 32, 128, 4, 3, None),
        (1, 16, 512, 8, 4, None),
    ],
    "fp8_dot": [
        (16, 64, 128, 4, 4, None),
        (16, 128, 128, 4, 3, None),
        (16, 64, 256, 4, 3, None),
        (16, 128, 64, 4, 4, None),
    ],
    "awq_cuda_core": [
        (1, 256, 32, 4, 4, False),
        (1, 128, 64, 4, 3, False),
        (1, 256, 64, 8, 3, False),
        (1, 512, 16, 4, 4, False),
    ],
    "awq_dot": [
        (16, 128, 64, 4, 3, True),
        (16, 64, 128, 4, 4, True),
        (16, 128, 64, 4, 3, False),
        (16, 256, 64, 8, 3, True),
    ],
}


def sweep(
    shapes: dict[str, tuple[int, int]], device: torch.device, budget_s: float, copy_Bps: float
) -> list[dict[str, Any]]:
    """Tiles of the W8A16 and AWQ kernels at M = 1 and 16 on the given shapes, until the budget is spent (each
    new tile is a compile).  The CUDA-core loops run at M = 1 only."""
    bench = _timer(device)
    started = time.monotonic()
    trials: list[dict[str, Any]] = []
    for layer, (k, n) in shapes.items():
        w = weights(k, n, device)
        for m in (1, 16):
            x = torch.randn(m, k, device=device, dtype=torch.float32).bfloat16()
            for kernel, tiles in SWEEP.items():
                if kernel.endswith("cuda_core") and m > 1:
                    continue
                for bm, bn, bk, warps, stages, swap in tiles:
                    if time.monotonic() - started > budget_s:
                        trials.append({"stopped": f"budget of {budget_s:.0f} s spent"})
                        return trials
                    cfg: dict[str, Any] = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                    if kernel != "fp8_cuda_core":
                        cfg["BLOCK_M"] = bm
                    if swap is not None:
                        cfg["SWAP_AB"] = swap
                    trial: dict[str, Any] = {"kernel": kernel, "layer": layer, "M": m, **cfg}
                    try:
                        ms = bench(_sweep_fn(kernel, w, x, cfg))
                        fmt = "fp8" if kernel.startswith("fp8") else "awq"
                        trial.update(
                            ms=round(ms, 5), over_floor=round(ms / floors(k, n, m, copy_Bps)[f"{fmt}_floor_ms"], 3)
                        )
                    except Exception as e:  # noqa: BLE001 - a tile that does not fit: say so
                        trial["error"] = f"{type(e).__name__}: {e}"[:200]
                    trials.append(trial)
                    print(f"sweep {trial}", flush=True)
    return trials


# -- kernels/w4a16_tc.py: the tensor-core AWQ GEMM's tiles -----------------------------------------------------

TC_ROWS = (8, 16, 32, 64, 128, 192, 256)
TC_BASE = ("bf16", "fp16", "awq_dequantize_cublas", "awq_dot")


def tc_label(cfg: dict[str, Any], one_dot: bool = True, in_kernel: bool = False) -> str:
    """A tile's column label: s<BLOCK_M>x<BLOCK_N>w<warps>s<stages>v<waves>, then p16 for a dot per nibble plane
    (ONE_DOT False) and k for the splits summed inside the kernel (IN_KERNEL)."""
    return (
        f"s{cfg['BLOCK_M']}x{cfg['BLOCK_N']}w{cfg['num_warps']}s{cfg['num_stages']}v{cfg.get('WAVES', 2)}"
        + ("" if one_dot else "p16")
        + ("k" if in_kernel else "")
    )


def tc_variants(m: int) -> dict[str, tuple[dict[str, Any], int | None]]:
    """label -> (config, None) of the default tile at `m` rows (kernels/w4a16_tc.py's tc_config) with its two
    instruction-count options on and off: WORD_PAIRS (label suffix w: two words a dequantization step, each float16
    pair already the MMA operand's) and EVEN (e: whole tiles loaded without masks where M and N allow); above 128
    rows also K split for about 4 programs per SM (v4), the splits summed by a second kernel or inside (k)."""
    from kernels.w4a16_tc import tc_config

    base = tc_config(m, 4096, 4096)
    one_dot, in_kernel = base.get("ONE_DOT", True), base.get("IN_KERNEL", False)
    out: dict[str, tuple[dict[str, Any], int | None]] = {}
    for pairs, even in ((False, False), (True, False), (False, True), (True, True)):
        cfg = dict(base, WORD_PAIRS=pairs, EVEN=even)
        label = tc_label(base, one_dot, in_kernel) + ("w" if pairs else "") + ("e" if even else "")
        out[label] = (cfg, None)
    if m > 128:  # the wide layer's 448 tiles are 3.4 waves: K split for about 4 programs per SM fills the last one
        for k_sum in (False, True):
            cfg = dict(base, WAVES=4, IN_KERNEL=k_sum)
            out[tc_label(cfg, one_dot, k_sum)] = (cfg, None)
    return out


def tc_candidates(m: int) -> dict[str, tuple[dict[str, Any], int | None]]:
    """label -> (config, splits or None for the default) of the tensor-core AWQ tiles tried at `m` rows (the first
    sweep, quant-kernels-h200-2026-11-28-tc.json, tried x on the MMA's wide side too: 2-7x slower, dropped)."""
    import triton

    p2 = max(16, triton.next_power_of_2(m))
    out: dict[str, tuple[dict[str, Any], int | None]] = {}

    def add(
        bm: int,
        bn: int,
        warps: int,
        stages: int,
        waves: int = 2,
        maxnreg: int | None = None,
        one_dot: bool = True,
        in_kernel: bool = False,
    ):
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, SWAP_AB=True, num_warps=warps, num_stages=stages, WAVES=waves)
        label = tc_label(cfg, one_dot, in_kernel) + ("" if maxnreg is None else f"r{maxnreg}")
        cfg.update(ONE_DOT=one_dot, IN_KERNEL=in_kernel)
        if maxnreg is not None:
            cfg["maxnreg"] = maxnreg
        out.setdefault(label, (cfg, None))

    if m <= 64:  # a dot per nibble plane (p16) or one over the joined planes; splits summed in the kernel (k) or not
        add(p2, 64, 4, 3, waves=4)
        add(p2, 64, 4, 3, waves=4, one_dot=False)
        add(p2, 64, 4, 3, waves=4, one_dot=False, in_kernel=True)
        add(p2, 64, 4, 4, waves=4, one_dot=False, in_kernel=True)
        add(p2, 64, 4, 3, waves=8, one_dot=False, in_kernel=True)
        add(p2, 64, 4, 4, waves=2, one_dot=False, in_kernel=True)
        add(p2, 128, 4, 3, waves=4, one_dot=False, in_kernel=True)
        add(p2, 128, 8, 3, waves=4, one_dot=False, in_kernel=True)
        add(p2, 32, 4, 4, waves=8, one_dot=False, in_kernel=True)
    if m >= 64:  # x read from L2 costs 2 / BLOCK_N bytes a MAC, the weight 0.5 / BLOCK_M: wider weight tiles first
        add(128, 128, 8, 3)
        add(64, 256, 8, 3)
        add(64, 256, 8, 4)
        add(128, 128, 8, 3, one_dot=False)
        add(128, 256, 16, 3)
        add(128, 256, 16, 3, one_dot=False)
        add(128, 256, 8, 3)
        add(min(p2, 256), 64, 8, 3)  # one pass over up to 256 rows: two warp groups of 128 rows each
        add(min(p2, 256), 64, 8, 3, one_dot=False)
        add(min(p2, 256), 128, 8, 2)
        add(64, 256, 8, 3, one_dot=False)
        add(128, 128, 8, 4)
    return out


def _tc_fn(w: dict[str, torch.Tensor], x16: torch.Tensor, cfg: dict[str, Any] | None, splits: int | None):
    from kernels.w4a16_tc import w4a16_tc

    return lambda: w4a16_tc(x16, w["tc_packed"], w["tc_zf"], w["scales"], GROUP, config=cfg, splits=splits)


def _tc_dense_fn(w: dict[str, torch.Tensor], x16: torch.Tensor):
    """The many-row path of a layer that keeps only the repacked weight: dequantized from it, then cuBLAS."""
    from kernels.w4a16_tc import tc_dequantize

    return lambda: x16 @ tc_dequantize(w["tc_packed"], w["tc_zf"], w["scales"], GROUP, x16.dtype)


def _tc_routed_fn(w: dict[str, torch.Tensor], x16: torch.Tensor):
    """What the engine's repacked layer runs: kernels/quant_cuda.py's awq_linear, its path by rows and columns."""
    from kernels import quant_cuda

    repacked = (w["tc_packed"], w["tc_zf"])
    return lambda: quant_cuda.awq_linear(x16, None, None, w["scales"], GROUP, repacked=repacked)


def tc_measure(
    shapes: dict[str, tuple[int, int]],
    rows: tuple[int, ...],
    device: torch.device,
    save,
    budget_s: float,
    default_only: bool = False,
    variants_only: bool = False,
) -> list[dict[str, Any]]:
    from benchmarks.kernels import bench_rotating
    from kernels.w4a16_tc import awq_repack

    bench = _timer(device)
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    for layer, (k, n) in shapes.items():
        w = weights(k, n, device)
        w["tc_packed"], w["tc_zf"] = awq_repack(w["qweight"], w["qzeros"], GROUP)
        copies = [w] + [_copy_inputs(w) for _ in range(rotations(k, n) - 1)] if device.type == "cuda" else [w]
        for m in rows:
            gx = torch.Generator(device=device).manual_seed(m)
            x = torch.randn(m, k, generator=gx, device=device, dtype=torch.float32).bfloat16()
            x16 = x.half()
            row: dict[str, Any] = {"layer": layer, "K": k, "N": n, "M": m}
            errors: dict[str, str] = {}
            fns: dict[str, Callable[[Any], Callable[[], Any]]] = {
                name: (lambda c, name=name: variants(m, c, x, x16)[name]) for name in TC_BASE
            }
            fns["awq_tc"] = lambda c: _tc_fn(c, x16, None, None)
            fns["awq_tc_dense"] = lambda c: _tc_dense_fn(c, x16)
            fns["awq_tc_routed"] = lambda c: _tc_routed_fn(c, x16)
            cands = {} if default_only else tc_variants(m) if variants_only else tc_candidates(m)
            for label, (cfg, splits) in cands.items():
                fns[f"awq_tc[{label}]"] = lambda c, cfg=cfg, splits=splits: _tc_fn(c, x16, cfg, splits)
            for name, make in fns.items():
                if time.monotonic() - started > budget_s:
                    errors[name] = f"not timed: budget of {budget_s:.0f} s spent"
                    continue
                try:
                    fn = make(w)
                    got = fn()
                    want = _reference("awq" if name.startswith("awq") else name, w, x, x16)
                    if not _checked(row, errors, name, got, want, TOLERANCE["awq" if name.startswith("awq") else ""]):
                        continue
                    if len(copies) > 1:
                        row[f"{name}_ms"] = round(bench_rotating([make(c) for c in copies]), 5)
                    else:
                        row[f"{name}_ms"] = round(bench(fn), 5)
                except Exception as e:  # noqa: BLE001 - one tile that fails to compile or run: record it, keep going
                    errors[name] = f"{type(e).__name__}: {e}"[:400]
                    traceback.print_exc()
            tiles = {key[:-3]: v for key, v in row.items() if key.startswith("awq_tc[") and key.endswith("_ms")}
            if tiles:
                row["tc_best"] = min(tiles, key=lambda t: tiles[t])
            if errors:
                row["errors"] = errors
            results.append(row)
            print(
                f"{layer} M={m}: bf16 {row.get('bf16_ms')} fp16 {row.get('fp16_ms')} dequant+cuBLAS "
                f"{row.get('awq_dequantize_cublas_ms')} dot {row.get('awq_dot_ms')} tc {row.get('awq_tc_ms')} best "
                f"{row.get('tc_best')} {tiles.get(row.get('tc_best', ''), '')}"
                + (f"; errors {errors}" if errors else ""),
                flush=True,
            )
        del w, copies
        save(results)
    return results


def tc_rule(results: list[dict[str, Any]], rows: tuple[int, ...], layers: int) -> dict[str, Any]:
    """Per M: the four projections summed for every path and tile timed on all four, the fastest tile, and the
    layer time with each projection at its own fastest tile (`awq_tc_per_shape_best`)."""
    out: dict[str, Any] = {}
    for m in rows:
        at_m = [r for r in results if r["M"] == m]
        if len(at_m) != layers:
            continue
        totals = {
            key.removesuffix("_ms"): round(sum(r[key] for r in at_m), 5)
            for key in at_m[0]
            if key.endswith("_ms") and all(key in r for r in at_m)
        }
        tiles = {p: t for p, t in totals.items() if p.startswith("awq_tc[")}
        entry: dict[str, Any] = {"layer_ms": totals}
        if tiles:
            entry["tc_fastest"] = min(tiles, key=lambda p: tiles[p])
        if all("tc_best" in r for r in at_m):
            entry["per_shape_best"] = {r["layer"]: r["tc_best"] for r in at_m}
            entry["awq_tc_per_shape_best_ms"] = round(sum(r[f"{r['tc_best']}_ms"] for r in at_m), 5)
        out[str(m)] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="CPU dry run: small shapes, Triton's interpreter")
    p.add_argument("--sweep-budget-s", type=float, default=0.0, help="seconds of tile sweeps after the table")
    p.add_argument(
        "--decode", action="store_true", help="M = 1, 2, 4, 8, 16, 32 and the decode paths only (about a minute)"
    )
    p.add_argument("--tc", action="store_true", help="kernels/w4a16_tc.py's tiles at M = 32..512 (one GPU)")
    p.add_argument("--tc-budget-s", type=float, default=330.0, help="with --tc: stop timing after this many seconds")
    p.add_argument("--tc-rows", default="", help="with --tc: the row counts, comma-separated (default: TC_ROWS)")
    p.add_argument("--tc-default-only", action="store_true", help="with --tc: the default tile only, no candidates")
    p.add_argument(
        "--tc-variants", action="store_true", help="with --tc: the default tile with and without WORD_PAIRS and EVEN"
    )
    args = p.parse_args(argv)
    from benchmarks.kernels import device_slug, interpreted_or_cuda

    device = interpreted_or_cuda(args.quick)
    if device is None:
        return 2
    gpu = device.type == "cuda"
    from benchmarks.throughput import copy_bandwidth

    name = device_slug(gpu)
    shapes, rows = (SHAPES, ROWS) if gpu else (QUICK_SHAPES, QUICK_ROWS)
    if args.decode:
        rows = DECODE_ROWS if gpu else (1, 2, 16)
    from kernels import quant_cuda

    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "date": dt.date.today().isoformat(),
        "command": "python -m benchmarks.quant_kernels " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "group_size": GROUP,
        "timer": "bench_rotating: one CUDA graph of the call on rotating weight copies (>= 192 MiB of the smallest "
        "format), median of 30 replays after an L2-clearing read, divided by the copies"
        if gpu
        else "CPU dry run: each path's checked call, timed once (times say nothing of a GPU's)",
        "rule_in_use": {
            "FP8_W8A16_MAX_ROWS": quant_cuda.qr.FP8_W8A16_MAX_ROWS,
            "FP8_CUDA_CORE_MAX_ROWS": quant_cuda.FP8_CUDA_CORE_MAX_ROWS,
            "AWQ_CUDA_CORE_MAX_ROWS": quant_cuda.AWQ_CUDA_CORE_MAX_ROWS,
            "AWQ_DENSE_MIN_ROWS": quant_cuda.AWQ_DENSE_MIN_ROWS,
            "FP8_GEMV_MAX_ROWS": quant_cuda.FP8_GEMV_MAX_ROWS,
            "AWQ_GEMV2_MAX_ROWS": quant_cuda.AWQ_GEMV2_MAX_ROWS,
            "AWQ_TC_DENSE_MIN_ROWS": quant_cuda.AWQ_TC_DENSE_MIN_ROWS,
            "AWQ_TC_WIDE_ROWS": [quant_cuda.AWQ_TC_WIDE_MIN_ROWS, quant_cuda.AWQ_TC_WIDE_MAX_ROWS],
            "AWQ_TC_WIDE_MIN_N": quant_cuda.AWQ_TC_WIDE_MIN_N,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"quant-kernels-{name}-{result['date']}{'-tc' if args.tc else ''}.json"
    started = time.monotonic()
    if args.tc:
        tc_rows = tuple(int(r) for r in args.tc_rows.split(",")) if args.tc_rows else TC_ROWS if gpu else (3, 17)

        def save_tc(rows_so_far: list[dict[str, Any]]) -> None:
            result["rows"] = rows_so_far
            result["tc_rule"] = tc_rule(rows_so_far, tc_rows, len(shapes))
            result["seconds"] = round(time.monotonic() - started, 1)
            path.write_text(json.dumps(result, indent=2) + "\n")

        results = tc_measure(shapes, tc_rows, device, save_tc, args.tc_budget_s, args.tc_default_only, args.tc_variants)
        save_tc(results)
        for m, entry in result["tc_rule"].items():
            ms = entry["layer_ms"]
            print(
                f"M={m}: bf16 {ms.get('bf16')} fp16 {ms.get('fp16')} dequant+cuBLAS {ms.get('awq_dequantize_cublas')} "
                f"dot {ms.get('awq_dot')} tc {ms.get('awq_tc')} tc-dense {ms.get('awq_tc_dense')} "
                f"fastest {entry.get('tc_fastest')} "
                f"{ms.get(entry.get('tc_fastest', ''), '')} per-shape best {entry.get('awq_tc_per_shape_best_ms')}"
            )
        print(f"wrote {path}")
        return 1 if any("errors" in r for r in results) else 0

    def save(rows_so_far: list[dict[str, Any]]) -> None:
        result["rows"] = rows_so_far
        result["rule"] = rule(rows_so_far, rows, len(shapes))
        result["seconds"] = round(time.monotonic() - started, 1)
        path.write_text(json.dumps(result, indent=2) + "\n")

    result["copy_TBps"] = round(copy_bandwidth(device, (2 << 30) if gpu else (64 << 20)) / 1e12, 4)
    copy_Bps = result["copy_TBps"] * 1e12
    results = measure(shapes, rows, device, copy_Bps, save, only=DECODE_PATHS if args.decode else None)
    save(results)
    if args.sweep_budget_s > 0:
        sweep_shapes = {k: SHAPES[k] for k in ("o_proj", "gate_up_proj")} if gpu else dict(list(shapes.items())[:1])
        result["sweep"] = sweep(sweep_shapes, device, args.sweep_budget_s, copy_Bps)
        save(results)
    for m, entry in result["rule"].items():
        print(f"M={m}: fastest fp8 {entry.get('fp8_fastest')}, awq {entry.get('awq_fastest')}; {entry['layer_ms']}")
    if gpu:
        from benchmarks.kernels import EAGER_FALLBACKS

        result["eager_fallbacks"] = EAGER_FALLBACKS
        save(results)
    print(f"wrote {path}")
    failed = [r for r in results if "errors" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
