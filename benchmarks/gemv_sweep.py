"""Issue 39: tile / split / warps / stages sweep of the decode GEMVs (kernels/fp8_gemv.py, kernels/awq_gemv.py) per
row count and per projection of the Llama-3-8B shape, in one device call, to choose their tables by measurement.

    python -m benchmarks.gemv_sweep --out DIR [--budget-s 330]     # one GPU
    python -m benchmarks.gemv_sweep --quick --out DIR              # CPU dry run (TRITON_INTERPRET=1, tiny shapes)

Timed as benchmarks/quant_kernels.py times (benchmarks/kernels.py's bench_rotating: one CUDA graph of the call on
rotating weight copies, together >= 192 MiB of the format, after an L2-clearing read, divided by the copies).
Phases, most important first, each trial checked against the float32 product of the dequantized weight:

1. `reference`: bf16 F.linear, FP8 `_scaled_mm` (with its per-token quantization) and the current fp8_gemv default
   at M = 1, 2, 4, 8, 16, 32 (the same run's baselines);
2. `fp8_cuda_core`: the CUDA-core kernel's tiles (BLOCK_N, BLOCK_K, num_warps) at M = 1, 2, 4 with the default
   WAVES, then the best three tiles per M again with other WAVES (K splits) and MIN_STEPS;
3. `fp8_dot`: the tensor-core kernel's tiles (BLOCK_N, BLOCK_K, num_warps, num_stages) at M = 16 (BLOCK_M 16),
   the best three with other WAVES, the best with its dot in fp16 (what the e4m3 -> bf16 conversion costs), then
   the best four at M = 32 (BLOCK_M 32) where the kernel takes 32 rows (it did in the 2026-11-28 run, no longer),
   and the best at M = 4 and 8 (the dot against the CUDA-core kernel);
4. `awq`: awq_gemv's tiles (BLOCK_N, BLOCK_K, num_warps, programs per SM) at M = 1 and the best three at M = 2.

Each trial: `layer_ms` (the four projections summed, one decoder layer's linears) and `ms` per projection, its
bytes over time (`TBps`, compare `copy_TBps`), relative error.  `best` names the fastest config per phase and M.
The JSON (DIR/gemv-sweep-<gpu>-<date>.json) is rewritten after every trial; a phase that would pass --budget-s
is cut short (recorded in `stopped`).
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
from functools import partial
from pathlib import Path
from typing import Any

import torch

SHAPES = {"qkv_proj": (4096, 6144), "o_proj": (4096, 4096), "gate_up_proj": (4096, 28672), "down_proj": (14336, 4096)}
QUICK_SHAPES = {"qkv_proj": (128, 64)}  # one AWQ group, one tile wide: the interpreter pays per step
ROWS = (1, 2, 4, 8, 16, 32)
GROUP = 128
ROTATE_BYTES = 192 << 20
# (BLOCK_N, BLOCK_K, num_warps) of the CUDA-core kernel
CUDA_CORE_TILES = [
    (16, 512, 4),
    (8, 512, 4),
    (8, 1024, 4),
    (16, 1024, 4),
    (32, 256, 4),
    (32, 512, 4),
    (16, 256, 4),
    (16, 512, 8),
    (32, 512, 8),
    (16, 1024, 8),
    (64, 256, 8),
    (4, 1024, 4),
]
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the dot kernel
DOT_TILES = [
    (128, 128, 4, 4),
    (64, 128, 4, 3),
    (64, 128, 4, 5),
    (64, 256, 4, 3),
    (64, 256, 4, 4),
    (128, 128, 4, 3),
    (128, 128, 8, 4),
    (128, 256, 8, 3),
    (256, 128, 8, 3),
    (128, 64, 4, 6),
    (64, 512, 4, 2),
    (128, 256, 4, 2),
]
# (BLOCK_N, BLOCK_K, num_warps, programs per SM) of awq_gemv
AWQ_TILES = [
    (256, 32, 1, 16),
    (256, 32, 1, 8),
    (256, 32, 1, 32),
    (128, 32, 1, 16),
    (512, 32, 1, 16),
    (256, 64, 1, 16),
    (256, 16, 1, 16),
    (256, 32, 2, 8),
    (256, 64, 2, 8),
    (512, 32, 2, 8),
    (256, 128, 4, 4),
    (128, 64, 1, 32),
]
WAVES = (1, 2, 4, 8, 16)


class Budget:
    def __init__(self, seconds: float):
        self.started = time.monotonic()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)


def _timer(device: torch.device) -> Callable[[list[Callable[[], Any]]], float]:
    if device.type == "cuda":
        from benchmarks.kernels import bench_rotating

        return bench_rotating

    def cpu_ms(fns: list[Callable[[], Any]]) -> float:  # the dry run: one interpreted call, its time meaningless
        t = time.perf_counter()
        fns[0]()
        return (time.perf_counter() - t) * 1e3

    return cpu_ms


class Projection:
    """One projection's weights in both formats, copied for the rotating timer, and x per row count."""

    def __init__(self, k: int, n: int, device: torch.device, copies: bool):
        from kernels import quant_reference as qr

        g = torch.Generator(device=device).manual_seed(k + n)
        w = torch.randn(n, k, generator=g, device=device, dtype=torch.float32) * 0.02
        wq, ws = qr.quantize_rows(w)
        self.k, self.n = k, n
        self.bf16 = [w.bfloat16()]
        self.fp8 = [(wq, ws)]
        self.fp8_dense = wq.float() * ws[:, None]
        # AWQ: random packed nibbles and zero points (timing only needs the layout; the reference dequantizes them)
        qweight = torch.randint(-(2**31), 2**31 - 1, (k, n // 8), generator=g, device=device, dtype=torch.int32)
        qzeros = torch.randint(-(2**31), 2**31 - 1, (k // GROUP, n // 8), generator=g, device=device, dtype=torch.int32)
        scales = (torch.rand(k // GROUP, n, generator=g, device=device) * 0.002 + 1e-4).half()
        self.awq = [(qweight, qzeros, scales)]
        self.awq_dense = qr.awq_dequantize(qweight, qzeros, scales, GROUP).float()
        if copies:
            for _ in range(max(2, math.ceil(ROTATE_BYTES / (k * n))) - 1):
                self.fp8.append((wq.clone(), ws.clone()))
            for _ in range(max(2, math.ceil(ROTATE_BYTES / (k * n // 2))) - 1):
                self.awq.append((qweight.clone(), qzeros.clone(), scales.clone()))
            for _ in range(max(2, math.ceil(ROTATE_BYTES / (2 * k * n))) - 1):
                self.bf16.append(self.bf16[0].clone())
        self.x: dict[int, torch.Tensor] = {}

    def rows(self, m: int) -> torch.Tensor:
        if m not in self.x:
            gx = torch.Generator(device=self.fp8_dense.device).manual_seed(m)
            self.x[m] = torch.randn(m, self.k, generator=gx, device=self.fp8_dense.device).bfloat16()
        return self.x[m]

    def bytes(self, fmt: str, m: int) -> int:
        acts = 2 * m * (self.k + self.n)
        k, n = self.k, self.n
        return {
            "bf16": 2 * k * n,
            "fp8": k * n + 4 * n,
            "awq": k * n // 2 + (k // GROUP) * n * 5 // 2,
        }[fmt] + acts


def _calls(path: str, p: Projection, m: int, cfg: dict[str, Any]) -> tuple[list[Callable[[], Any]], str]:
    """The calls of `path` on each copy of the projection's weights, and the format they read."""
    import torch.nn.functional as F

    from kernels import fp8_linear as f8
    from kernels import quant_cuda
    from kernels.awq_gemv import awq_gemv
    from kernels.fp8_gemv import fp8_gemv

    x = p.rows(m)
    if path == "bf16":
        return [partial(F.linear, x, w) for w in p.bf16], "bf16"
    if path == "fp8_scaled_mm":

        def scaled(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return quant_cuda.scaled_mm(*f8.quantize_per_token(x), w, s, x.dtype)

        return [partial(scaled, w, s) for w, s in p.fp8], "fp8"
    if path == "fp8_gemv":
        return [partial(fp8_gemv, x, w, s, config=cfg or None) for w, s in p.fp8], "fp8"
    if path == "awq_gemv":
        x16 = x.half()
        return [partial(awq_gemv, x16, q, z, s, GROUP, config=cfg or None) for q, z, s in p.awq], "awq"
    raise ValueError(path)


def _reference(fmt: str, p: Projection, m: int) -> torch.Tensor:
    x = p.rows(m)
    if fmt == "awq":
        return x.half().float() @ p.awq_dense
    return x.float() @ (p.fp8_dense if fmt == "fp8" else p.bf16[0].float()).t()


class Sweep:
    def __init__(self, shapes: dict[str, tuple[int, int]], device: torch.device, budget: Budget, save):
        self.device = device
        self.shapes = shapes
        self.projections = {
            name: Projection(k, n, device, copies=device.type == "cuda") for name, (k, n) in shapes.items()
        }
        self.timer = _timer(device)
        self.budget = budget
        self.trials: list[dict[str, Any]] = []
        self.stopped: list[str] = []
        self.save = save

    def trial(self, phase: str, path: str, m: int, cfg: dict[str, Any], reserve_s: float = 0.0) -> dict | None:
        """Time `path` with `cfg` at `m` rows on every projection: one trial row (None when the budget is spent)."""
        if self.budget.left() < reserve_s + 5:
            note = f"{phase}: budget spent before {path} M={m} {cfg}"
            if not self.stopped or not self.stopped[-1].startswith(phase):
                self.stopped.append(note)
            return None
        row: dict[str, Any] = {"phase": phase, "path": path, "M": m, "config": dict(cfg), "ms": {}, "rel_err": {}}
        fmt = ""
        try:
            for name, p in self.projections.items():
                fns, fmt = _calls(path, p, m, cfg)
                got = fns[0]()
                want = _reference(fmt, p, m)
                err = float((got.float() - want).norm() / want.norm())
                row["rel_err"][name] = float(f"{err:.3g}")
                if not err < (0.05 if path == "fp8_scaled_mm" else 0.01):
                    raise RuntimeError(f"{name}: relative error {err:.3g}")
                row["ms"][name] = round(self.timer(fns), 5)
            total = sum(row["ms"].values())
            row["layer_ms"] = round(total, 5)
            moved = sum(p.bytes(fmt, m) for p in self.projections.values())
            row["TBps"] = round(moved / (total * 1e-3) / 1e12, 3) if total > 0 else None
        except Exception as e:  # noqa: BLE001 - a config that fails to compile, run or match: record it
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            traceback.print_exc()
        self.trials.append(row)
        print(f"{phase} {path} M={m} {cfg}: {row.get('layer_ms', row.get('error'))}", flush=True)
        self.save()
        return row

    def ranked(self, phase: str, m: int, path: str | None = None) -> list[dict]:
        rows = [
            t
            for t in self.trials
            if t["phase"] == phase and t["M"] == m and "layer_ms" in t and (path is None or t["path"] == path)
        ]
        return sorted(rows, key=lambda t: t["layer_ms"])


def run(sweep: Sweep, rows: tuple[int, ...], quick: bool) -> None:
    cpu = sweep.device.type != "cuda"
    # 1. the same run's baselines
    from kernels.fp8_gemv import MAX_ROWS

    for m in rows:
        for path in ("bf16", "fp8_scaled_mm", "fp8_gemv"):
            if path != "fp8_gemv" or m <= MAX_ROWS:
                sweep.trial("reference", path, m, {})
    # 2. the CUDA-core kernel
    cc_tiles = CUDA_CORE_TILES[:1] if quick else CUDA_CORE_TILES
    for m, block_m in ((1, 1), (2, 2)) if quick else ((1, 1), (2, 2), (4, 4)):
        base = dict(KIND="cuda-core", BLOCK_M=block_m, num_stages=1)
        for bn, bk, warps in cc_tiles:
            if cpu:
                bk = 64
            sweep.trial("fp8_cuda_core", "fp8_gemv", m, dict(base, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, WAVES=4))
        for best in sweep.ranked("fp8_cuda_core", m)[: 0 if quick else 3]:
            for waves, min_steps in ((1, 4), (2, 4), (8, 4), (16, 2)) if not quick else ((1, 4),):
                sweep.trial("fp8_cuda_core", "fp8_gemv", m, dict(best["config"], WAVES=waves, MIN_STEPS=min_steps))
    # 3. the dot kernel
    dot_tiles = DOT_TILES[:1] if quick else DOT_TILES
    base = dict(KIND="dot", BLOCK_M=16)
    for bn, bk, warps, stages in dot_tiles:
        if cpu:
            bn, bk = 64, 64
        cfg = dict(base, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, WAVES=2)
        sweep.trial("fp8_dot", "fp8_gemv", 16, cfg)
    for best in sweep.ranked("fp8_dot", 16)[: 0 if quick else 3]:
        for waves in (1, 4, 8) if not quick else (4,):
            sweep.trial("fp8_dot", "fp8_gemv", 16, dict(best["config"], WAVES=waves))
    top = sweep.ranked("fp8_dot", 16)
    if top:
        sweep.trial("fp8_dot", "fp8_gemv", 16, dict(top[0]["config"], DOT_FP16=True))
    if MAX_ROWS >= 32:  # the 2026-11-28 sweep's kernel took 32 rows (BLOCK_M 32: 0.25 ms a layer, since dropped)
        for best in top[: 1 if quick else 4]:
            sweep.trial("fp8_dot", "fp8_gemv", 32, dict(best["config"], BLOCK_M=32))
    if top:
        for m in (4, 8):
            sweep.trial("fp8_dot", "fp8_gemv", m, dict(top[0]["config"]))
    # 4. AWQ
    awq_tiles = AWQ_TILES[:1] if quick else AWQ_TILES
    for bn, bk, warps, per_sm in awq_tiles:
        if cpu:
            bn, bk = 64, 64
        splits_by = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, PER_SM=per_sm)
        sweep.trial("awq", "awq_gemv", 1, splits_by)
    for best in sweep.ranked("awq", 1)[: 1 if quick else 3]:
        sweep.trial("awq", "awq_gemv", 2, dict(best["config"]))


def best_table(trials: list[dict]) -> dict[str, Any]:
    """Per phase and M, the fastest config (by the layer's four projections) and its time."""
    out: dict[str, Any] = {}
    for t in trials:
        if "layer_ms" not in t:
            continue
        key = f"{t['phase']}:{t['path']}:M={t['M']}"
        if key not in out or t["layer_ms"] < out[key]["layer_ms"]:
            out[key] = {"config": t["config"], "layer_ms": t["layer_ms"], "ms": t["ms"], "TBps": t["TBps"]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="CPU dry run: tiny shapes, Triton's interpreter")
    p.add_argument("--budget-s", type=float, default=330.0)
    args = p.parse_args(argv)
    from benchmarks.kernels import device_slug, interpreted_or_cuda

    device = interpreted_or_cuda(args.quick)
    if device is None:
        return 2
    gpu = device.type == "cuda"
    from benchmarks.throughput import copy_bandwidth

    budget = Budget(args.budget_s)
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "date": dt.date.today().isoformat(),
        "command": "python -m benchmarks.gemv_sweep " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "group_size": GROUP,
        "timer": "bench_rotating (benchmarks/kernels.py)" if gpu else "CPU dry run: one interpreted call",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gemv-sweep-{device_slug(gpu)}-{result['date']}.json"
    result["copy_TBps"] = round(copy_bandwidth(device, (2 << 30) if gpu else (4 << 20)) / 1e12, 4)
    shapes = SHAPES if gpu else QUICK_SHAPES
    holder: dict[str, Sweep] = {}

    def save() -> None:
        s = holder.get("sweep")
        if s is None:
            return
        result["trials"] = s.trials
        result["best"] = best_table(s.trials)
        result["stopped"] = s.stopped
        result["seconds"] = round(time.monotonic() - budget.started, 1)
        path.write_text(json.dumps(result, indent=2) + "\n")

    sweep = holder["sweep"] = Sweep(shapes, device, budget, save)
    floors = {fmt: sum(p.bytes(fmt, 1) for p in sweep.projections.values()) for fmt in ("bf16", "fp8", "awq")}
    result["layer_floor_ms_at_M1"] = {f: round(b / (result["copy_TBps"] * 1e12) * 1e3, 5) for f, b in floors.items()}
    run(sweep, ROWS if gpu else (1, 2, 16), quick=not gpu)
    save()
    for key, entry in result["best"].items():
        print(f"{key}: {entry['layer_ms']} ms ({entry['TBps']} TB/s) {entry['config']}")
    print(f"layer floors at M=1: {result['layer_floor_ms_at_M1']}; stopped: {sweep.stopped or 'no'}")
    print(f"wrote {path}")
    return 0 if not any("error" in t for t in sweep.trials) else 1


if __name__ == "__main__":
    sys.exit(main())
