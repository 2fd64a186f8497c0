"""Issue 39: a batch-1 decode layer with FP8 weights (the Llama-3-8B shape) in the engine's kernel order, with
programmatic dependent launch (kernels/pdl.py) off and on, in one device call.

    python -m benchmarks.pdl_layer --out DIR [--rounds 3] [--profile] [--tag=-x]    # one Hopper GPU

The layer: add+RMSNorm, qkv product, rotary, KV write, decode attention (with its combine), o product,
add+RMSNorm, gate_up product, SiLU-mul, down product; the products on kernels/fp8_gemv.py's one-row default.
Timed as a captured decode step runs it: `bench_rotating` (benchmarks/kernels.py), one CUDA graph of 32 layers'
own weights and buffers after an L2-clearing read, divided by the layers.  Arms: ``PAGEKEEPER_PDL=0`` ("off",
plain launches) and ``1`` ("on"), each timed in ``--rounds`` rounds, alternating, so that the arms share the GPU's
state.  The four products alone (same graphs, no small kernels) are timed the same way.  Each arm's layer output
(graph replay) is checked against the plain arm's, bit for bit.  Floor: the layer's FP8 weight and scale bytes at
the run's copy speed.  `--profile`: each arm's kernels (start, duration) in one profiled replay of 4 layers.
DIR/pdl-layer-<gpu>-<date><tag>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch

from benchmarks.small_kernels import HIDDEN, HKV, HQ, INTER, D, Layers

SHAPES = dict(qkv=((HQ + 2 * HKV) * D, HIDDEN), o=(HIDDEN, HQ * D), gate_up=(2 * INTER, HIDDEN), down=(HIDDEN, INTER))


class Weights:
    """Each layer's FP8 weights (e4m3, per-row float32 scales) and norms."""

    def __init__(self, n: int, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(7)
        self.w: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for _ in range(n):
            layer = {}
            for name, (rows, cols) in SHAPES.items():
                w = (torch.randn(rows, cols, device=device, generator=g) * 0.5).to(torch.float8_e4m3fn)
                s = torch.rand(rows, device=device, generator=g) * 0.01 + 0.005
                layer[name] = (w, s)
            self.w.append(layer)
        self.norm_in = [torch.rand(HIDDEN, device=device, dtype=torch.bfloat16, generator=g) + 0.5 for _ in range(n)]
        self.norm_post = [torch.rand(HIDDEN, device=device, dtype=torch.bfloat16, generator=g) + 0.5 for _ in range(n)]

    def nbytes(self) -> int:
        return sum(w.numel() + s.numel() * 4 for w, s in self.w[0].values())


def _layer_ops(L: Layers, W: Weights) -> tuple[Callable[[int], None], Callable[[int], None], dict[int, torch.Tensor]]:
    from kernels.cache_ops import write_kv
    from kernels.fp8_gemv import fp8_gemv
    from kernels.fused_ops import rms_norm, rotary, silu_mul
    from kernels.paged_attention import paged_attention_decode

    outs: dict[int, torch.Tensor] = {}
    scale = D**-0.5

    def layer(i: int) -> None:
        w = W.w[i]
        h, res = rms_norm(L.x[i], W.norm_in[i], 1e-5, L.res[i])
        qkv = fp8_gemv(h, *w["qkv"])
        q = qkv[:, : HQ * D].view(1, HQ, D)
        k = qkv[:, HQ * D : (HQ + HKV) * D].view(1, HKV, D)
        v = qkv[:, (HQ + HKV) * D :].view(1, HKV, D)
        rotary(q, k, L.positions, L.cos, L.sin)
        write_kv(k, v, L.cache, L.slots[i])
        attn = paged_attention_decode(q, L.cache, L.tables[i], L.seq_lens, scale, L.max_len, out=L.out[i])
        o = fp8_gemv(attn.view(1, HQ * D), *w["o"])
        h2, res2 = rms_norm(o, W.norm_post[i], 1e-5, res)
        gu = fp8_gemv(h2, *w["gate_up"])
        a = silu_mul(gu)
        d = fp8_gemv(a, *w["down"])
        outs[i] = d

    def products(i: int) -> None:
        w = W.w[i]
        fp8_gemv(L.x[i], *w["qkv"])
        fp8_gemv(L.x[i], *w["o"])
        fp8_gemv(L.x[i], *w["gate_up"])
        fp8_gemv(L.gate_up[i][:, :INTER], *w["down"])

    return layer, products, outs


def _arm_env(arm: str) -> dict[str, str]:
    return {"PAGEKEEPER_PDL": "0" if arm == "off" else "1"}


def _profile(layer: Callable[[int], None], layers: int = 4) -> list[list]:
    """One replay of a graph of `layers` layers under the profiler: (start us from the first kernel, duration us,
    name) of each kernel in launch order."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(layers):
        layer(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(layers):
            layer(i)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    events = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not events:
        return []
    t0 = events[0][0]
    return [[round(a - t0, 2), round(b - a, 2), name[:60]] for a, b, name in events]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="each arm's kernels in one replay of 4 layers")
    p.add_argument("--tag", default="")
    p.add_argument("--notes", default="")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, not {args.rounds}")
    from benchmarks.kernels import bench_rotating, copy_tbps, device_slug, run_header

    if not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    device, gpu, n = torch.device("cuda"), True, 32
    started = time.monotonic()
    L = Layers(1, n, device)
    W = Weights(n, device)
    layer, products, outs = _layer_ops(L, W)
    arms = ["off", "on"]
    given = sys.argv[1:] if argv is None else argv
    timer = "bench_rotating over 32 layers' own weights, us per layer"
    result: dict[str, Any] = {**run_header("pdl_layer", given, gpu, timer), "notes": args.notes, "arms": arms}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"pdl-layer-{device_slug(gpu)}-{result['date']}{args.tag}.json"
    copy = copy_tbps()
    floor_us = W.nbytes() / (copy * 1e12) * 1e6
    result.update(copy_TBps=round(copy, 3), layer_weight_bytes=W.nbytes(), floor_us=round(floor_us, 2))
    times: dict[str, dict[str, list[float]]] = {a: {"layer": [], "products": []} for a in arms}
    checks: dict[str, float] = {}
    reference: torch.Tensor | None = None
    with mock.patch.dict(os.environ):  # each arm sets PAGEKEEPER_PDL; the caller's environment comes back after
        for r in range(args.rounds):
            for arm in arms:
                os.environ.update(_arm_env(arm))
                for what, fn in (("layer", layer), ("products", products)):
                    us = bench_rotating([lambda i=i: fn(i) for i in range(n)], reps=20) * 1e3
                    times[arm][what].append(round(us, 3))
                    if r == 0 and what == "layer":  # the graph's last replay left each layer's output in `outs`
                        got = outs[n - 1].float().clone()
                        if reference is None:
                            reference = got
                        checks[arm] = float((got - reference).abs().max())
                print(f"round {r} {arm}: layer {times[arm]['layer'][-1]} us, products {times[arm]['products'][-1]} us")
    rows = []
    for arm in arms:
        lay, prod = statistics.median(times[arm]["layer"]), statistics.median(times[arm]["products"])
        rows.append(
            dict(
                arm=arm,
                env=_arm_env(arm),
                layer_us=round(lay, 3),
                layer_over_floor=round(lay / floor_us, 3) if floor_us else None,
                products_us=round(prod, 3),
                products_over_floor=round(prod / floor_us, 3) if floor_us else None,
                rounds=times[arm],
                max_abs_diff_vs_off=checks.get(arm),
            )
        )
    if args.profile:
        profiles = {}
        with mock.patch.dict(os.environ):
            for arm in arms:
                os.environ.update(_arm_env(arm))
                profiles[arm] = _profile(layer)
        result["profiles"] = profiles
        for arm, ev in profiles.items():  # the second layer's kernels
            per = len(ev) // 4
            print(arm, "span of 4 layers", round(ev[-1][0] + ev[-1][1], 1) if ev else None, "us")
            for row in ev[per : 2 * per]:
                print("   ", row)
    result.update(rows=rows, seconds=round(time.monotonic() - started, 1))
    path.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        print(
            json.dumps(
                {k: row[k] for k in ("arm", "layer_us", "layer_over_floor", "products_us", "max_abs_diff_vs_off")}
            )
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
