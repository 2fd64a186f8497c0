"""Issue 39: the one-row FP8 decode product (kernels/fp8_gemv.py) on the Llama-3-8B shape's four projections, per
projection against its weight-read floor, in one device call: the committed default, the CUDA-core kernel's
tiles, and the streaming kernel (`_fp8_gemv_stream_kernel`: a grid of CTAS programs per SM, each looping over its
tiles' K steps through Triton's software pipeline, its weight tiles by pointer loads or TMA).

    python -m benchmarks.quant_gemv1 --out DIR [--budget-s 200]    # one GPU
    TRITON_INTERPRET=1 python -m benchmarks.quant_gemv1 --quick --out DIR

Timed as benchmarks/gemv_sweep.py times (bench_rotating: one CUDA graph of the call on rotating weight copies
after an L2-clearing read, divided by the copies); each trial checked against the dequantized float32 product.
Phases: `reference` (bf16 F.linear, the default, and the CUDA-core kernel that was the one-row default before),
`stream` (the streaming kernel's tiles, stages, warps and programs per SM, with and without TMA), then `refine`
(the best two with other programs per SM and stages).  Each trial: ms per projection, the layer's sum, per
projection the ratio to its floor (the weight, scales and activations at the same run's copy speed), and (not in
`refine`) the same after a neighbour kernel (`ms_after_op`, below).  DIR/quant-gemv1-<gpu>-<date>.json,
rewritten after each trial.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.gemv_sweep import QUICK_SHAPES, SHAPES, Budget, Sweep, best_table

# (BLOCK_N, BLOCK_K, STAGES, num_warps, CTAS per SM (0: one program per tile), TMA): the best of the session's
# first two sweeps and their neighbours (docs/decisions/quant-paths.md, 2026-11-28m)
STREAM_TRIALS = [
    (8, 512, 4, 2, 8, False),  # the default (STREAM_ONE_ROW)
    (8, 1024, 3, 4, 4, False),
    (8, 512, 4, 4, 6, False),
    (8, 512, 3, 2, 8, False),
    (8, 1024, 3, 2, 8, False),
    (8, 512, 4, 2, 12, False),
    (16, 512, 3, 4, 4, False),
    (4, 1024, 3, 4, 0, False),
    (16, 256, 4, 2, 8, True),
    (16, 256, 3, 2, 8, True),
]
CUDA_CORE_DEFAULT = dict(KIND="cuda-core", BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1)


def stream_cfg(bn: int, bk: int, stages: int, warps: int, ctas: int, tma: bool) -> dict[str, Any]:
    return dict(KIND="stream", BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, num_warps=warps, CTAS=ctas, TMA=tma)


class Probe:
    """Trials on every projection: alone (the rotating timer) and after a neighbour kernel (an in-place multiply
    of x by 1, as a decode step's RMSNorm or SiLU writes the product's input just before it), the neighbour's own
    time subtracted: in the engine no quantized product follows another."""

    def __init__(self, shapes: dict[str, tuple[int, int]], device: torch.device, budget: Budget, save):
        self.sweep = Sweep(shapes, device, budget, save)
        self.gpu = device.type == "cuda"
        self.neighbour_ms: dict[str, float] = {}

    def neighbour(self, name: str) -> float:
        if name not in self.neighbour_ms:
            x = self.sweep.projections[name].rows(1)
            fns = [partial(torch.mul, x, 1.0, out=x) for _ in range(len(self.sweep.projections[name].fp8))]
            self.neighbour_ms[name] = self.sweep.timer(fns)
        return self.neighbour_ms[name]

    def trial(self, phase: str, cfg: dict[str, Any], path: str = "fp8_gemv", after: bool = True) -> dict | None:
        row = self.sweep.trial(phase, path, 1, cfg)
        if row is None or "error" in row or not after or not self.gpu:
            return row
        from kernels.fp8_gemv import fp8_gemv

        row["ms_after_op"] = {}
        for name, pr in self.sweep.projections.items():
            x = pr.rows(1)

            def both(w: torch.Tensor, s: torch.Tensor, x: torch.Tensor = x) -> None:
                torch.mul(x, 1.0, out=x)
                if path == "bf16":
                    torch.nn.functional.linear(x, w)
                else:
                    fp8_gemv(x, w, s, config=cfg or None)

            pairs = pr.fp8 if path != "bf16" else [(w, None) for w in pr.bf16]
            fns = [partial(both, w, s) for w, s in pairs]
            if path == "bf16":  # the neighbour's time over as many calls as bf16 has copies
                xs = [partial(torch.mul, x, 1.0, out=x) for _ in pairs]
                op = self.sweep.timer(xs)
            else:
                op = self.neighbour(name)
            row["ms_after_op"][name] = round(self.sweep.timer(fns) - op, 5)
        row["layer_ms_after_op"] = round(sum(row["ms_after_op"].values()), 5)
        print(f"  after op: {row['layer_ms_after_op']} {row['ms_after_op']}", flush=True)
        self.sweep.save()
        return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="CPU dry run: tiny shapes, Triton's interpreter")
    p.add_argument("--budget-s", type=float, default=200.0)
    args = p.parse_args(argv)
    from benchmarks.kernels import EAGER_FALLBACKS, device_slug, interpreted_or_cuda, run_header
    from benchmarks.throughput import copy_bandwidth

    device = interpreted_or_cuda(args.quick)
    if device is None:
        return 2
    gpu = device.type == "cuda"
    budget = Budget(args.budget_s)
    timer = "bench_rotating (benchmarks/kernels.py)" if gpu else "CPU dry run: one interpreted call"
    result: dict[str, Any] = run_header("quant_gemv1", sys.argv[1:] if argv is None else argv, gpu, timer)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"quant-gemv1-{device_slug(gpu)}-{result['date']}.json"
    result["copy_TBps"] = round(copy_bandwidth(device, (2 << 30) if gpu else (4 << 20)) / 1e12, 4)
    shapes = SHAPES if gpu else QUICK_SHAPES
    holder: dict[str, Probe] = {}

    def save() -> None:
        pr = holder.get("probe")
        if pr is None:
            return
        s = pr.sweep
        for t in s.trials:
            for key, out in (("ms", "over_floor"), ("ms_after_op", "over_floor_after_op")):
                if t.get(key):
                    t[out] = {k: round(v / floors[k], 3) for k, v in t[key].items() if k in floors}
        result["trials"] = s.trials
        result["best"] = best_table(s.trials)
        result["neighbour_ms"] = pr.neighbour_ms
        result["stopped"] = s.stopped
        result["eager_fallbacks"] = list(EAGER_FALLBACKS)
        result["seconds"] = round(time.monotonic() - budget.started, 1)
        path.write_text(json.dumps(result, indent=2) + "\n")

    probe = holder["probe"] = Probe(shapes, device, budget, save)
    copy = result["copy_TBps"] * 1e12
    floors = {name: pr.bytes("fp8", 1) / copy * 1e3 for name, pr in probe.sweep.projections.items()}
    bf16_floors = {name: pr.bytes("bf16", 1) / copy * 1e3 for name, pr in probe.sweep.projections.items()}
    result["floor_ms"] = {k: round(v, 5) for k, v in floors.items()}
    result["floor_ms"]["layer"] = round(sum(floors.values()), 5)
    result["bf16_floor_ms"] = {k: round(v, 5) for k, v in bf16_floors.items()}
    quick = not gpu
    probe.trial("reference", {}, path="bf16")
    probe.trial("reference", {})
    probe.trial("reference", dict(CUDA_CORE_DEFAULT, WAVES=2, MIN_STEPS=4))  # the one-row default before
    for trial in STREAM_TRIALS[:2] if quick else STREAM_TRIALS:
        bn, bk, stages, warps, ctas, tma = trial
        probe.trial("stream", stream_cfg(bn, 64 if quick else bk, stages, warps, ctas, tma))
    for best in probe.sweep.ranked("stream", 1)[: 0 if quick else 2]:
        c = best["config"]
        for key, values in (("CTAS", (4, 6, 8, 0)), ("STAGES", (3, 4, 5))):
            for v in values:
                if v != c[key] and probe.sweep.budget.left() > 10:
                    probe.trial("refine", dict(c, **{key: v}), after=False)
    save()
    if gpu:
        result["compiled"] = compiled_stream_kernels()
        save()
    for key, entry in result["best"].items():
        print(f"{key}: {entry['layer_ms']} ms ({entry['TBps']} TB/s) {entry['config']} {entry['ms']}")
    print(f"floors: {result['floor_ms']}; stopped: {probe.sweep.stopped or 'no'}")
    print(f"wrote {path}")
    return 0


def compiled_stream_kernels() -> list[dict[str, Any]]:
    """Registers, spills, shared memory and whether the loop was pipelined (cp.async / bulk tensor copies in the
    PTX) for each compiled variant of the streaming kernel."""
    from kernels.fp8_gemv import _fp8_gemv_stream_kernel

    rows = []
    for cache in getattr(_fp8_gemv_stream_kernel, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for key, k in kernels.items():
            try:
                ptx = k.asm.get("ptx", "")
                rows.append(
                    dict(
                        key=str(key)[-300:],
                        registers=getattr(k, "n_regs", None),
                        spills=getattr(k, "n_spills", None),
                        shared=k.metadata.shared,
                        num_warps=k.metadata.num_warps,
                        cp_async=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                        bulk_tensor=ptx.count("cp.async.bulk.tensor"),
                    )
                )
            except Exception as e:  # noqa: BLE001 - a diagnostic only
                rows.append(dict(key=str(key)[-300:], error=repr(e)[:200]))
    return rows


if __name__ == "__main__":
    sys.exit(main())
