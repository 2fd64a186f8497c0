"""Issue 39: the small per-layer kernels of a decode step (add+RMSNorm, rotary, KV write, decode attention, SiLU-mul)
at the Llama-3-8B shape, the current kernels against copies of earlier ones, in one device call.

    python -m benchmarks.small_kernels --out DIR [--base DIR_OF_OLD_KERNEL_FILES] [--tag=-x]
    TRITON_INTERPRET=1 python -m benchmarks.small_kernels --quick --out DIR

`--base` names a folder holding earlier copies of kernels/paged_attention.py, kernels/fused_ops.py and
kernels/cache_ops.py (an A/B inside one process): they are imported under other module names and timed beside the
current ones.  Timed as a captured decode step runs them: `bench_rotating` (benchmarks/kernels.py), one CUDA graph
of the call on 32 layers' own buffers (each layer's KV in its own blocks) after an L2-clearing read, divided by the
layers.  Rows:

- `kernels`: each kernel alone, ms per layer, old and new, at batch 1, 8, 32 and 256;
- `attention`: decode attention over contexts of 515 tokens (a 512-token prompt's third decode step) in graphs
  captured for a 1,024-token `max_model_len`, every split count, a few tiles, and each arm's default;
- `layer`: the six calls of a layer in the engine's order, old and new.

Each new output is checked against the old one (max abs difference).  DIR/small-kernels-<gpu>-<date><tag>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

HIDDEN, HQ, HKV, D, INTER = 4096, 32, 8, 128, 14336
BLOCK = 16
CTX, MAX_LEN = 515, 1024


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class Layers:
    """Per-layer inputs of `batch` sequences for `n` layers (each layer's own buffers and KV blocks)."""

    def __init__(self, batch: int, n: int, device: torch.device, ctx: int = CTX, max_len: int = MAX_LEN) -> None:
        g = torch.Generator(device=device).manual_seed(batch)
        dt_ = torch.bfloat16
        self.batch, self.n, self.max_len = batch, n, max_len
        per_seq = -(-max_len // BLOCK)
        blocks = n * batch * per_seq
        self.cache = torch.randn(2, blocks, HKV, BLOCK, D, device=device, dtype=dt_, generator=g)
        perm = torch.randperm(blocks, device=device, generator=g).to(torch.int32).view(n, batch, per_seq)
        self.tables = [perm[i].contiguous() for i in range(n)]
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device=device)
        self.positions = pos
        self.slots = [
            (t[:, (ctx - 1) // BLOCK].to(torch.int64) * BLOCK + (ctx - 1) % BLOCK).contiguous() for t in self.tables
        ]
        self.qkv = [torch.randn(batch, (HQ + 2 * HKV) * D, device=device, dtype=dt_, generator=g) for _ in range(n)]
        self.x = [torch.randn(batch, HIDDEN, device=device, dtype=dt_, generator=g) for _ in range(n)]
        self.res = [torch.randn(batch, HIDDEN, device=device, dtype=dt_, generator=g) for _ in range(n)]
        self.w = [torch.rand(HIDDEN, device=device, dtype=dt_, generator=g) + 0.5 for _ in range(n)]
        self.gate_up = [torch.randn(batch, 2 * INTER, device=device, dtype=dt_, generator=g) for _ in range(n)]
        self.out = [torch.empty(batch, HQ, D, device=device, dtype=dt_) for _ in range(n)]
        inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device=device).float() / D))
        freqs = torch.outer(torch.arange(max_len, device=device).float(), inv)
        self.cos, self.sin = freqs.cos().contiguous(), freqs.sin().contiguous()

    def q(self, i: int) -> torch.Tensor:
        return self.qkv[i][:, : HQ * D].view(self.batch, HQ, D)

    def k(self, i: int) -> torch.Tensor:
        return self.qkv[i][:, HQ * D : (HQ + HKV) * D].view(self.batch, HKV, D)

    def v(self, i: int) -> torch.Tensor:
        return self.qkv[i][:, (HQ + HKV) * D :].view(self.batch, HKV, D)


def _ops(mods: dict[str, ModuleType], L: Layers, attn_kw: dict[str, Any] | None = None) -> dict[str, Callable]:
    """The per-layer callables of one arm (`mods`: paged_attention, fused_ops, cache_ops modules)."""
    pa, fo, co = mods["paged_attention"], mods["fused_ops"], mods["cache_ops"]
    kw = attn_kw or {}
    scale = D**-0.5

    def norm(i: int) -> None:
        fo.rms_norm(L.x[i], L.w[i], 1e-5, L.res[i])

    def rotary(i: int) -> None:
        fo.rotary(L.q(i), L.k(i), L.positions, L.cos, L.sin)

    def write(i: int) -> None:
        co.write_kv(L.k(i), L.v(i), L.cache, L.slots[i])

    def attention(i: int) -> None:
        pa.paged_attention_decode(L.q(i), L.cache, L.tables[i], L.seq_lens, scale, L.max_len, out=L.out[i], **kw)

    def silu(i: int) -> None:
        fo.silu_mul(L.gate_up[i])

    def layer(i: int) -> None:
        norm(i)
        rotary(i)
        write(i)
        attention(i)
        norm(i)
        silu(i)

    return dict(norm=norm, rotary=rotary, kv_write=write, attention=attention, silu_mul=silu, layer=layer)


def _without_notes(args: list[str]) -> list[str]:
    """The command line less its --notes text (which the results file holds under "notes")."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--notes":
            skip = True
        elif not a.startswith("--notes="):
            out.append(a)
    return out


def _time(fn: Callable[[int], None], L: Layers, gpu: bool) -> float:
    if not gpu:
        fn(0)
        return 0.0
    from benchmarks.kernels import bench_rotating

    fns = [lambda i=i: fn(i) for i in range(L.n)]
    return round(bench_rotating(fns, reps=20) * 1e3, 3)  # us per layer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--base", type=Path, default=None, help="folder of earlier kernel files (the A arm)")
    p.add_argument("--quick", action="store_true", help="CPU dry run: Triton's interpreter, batch 1, 2 layers")
    p.add_argument("--tag", default="")
    p.add_argument("--notes", default="")
    args = p.parse_args(argv)
    from benchmarks.kernels import device_slug, interpreted_or_cuda, run_header

    device = interpreted_or_cuda(args.quick)
    if device is None:
        return 2
    gpu = device.type == "cuda"
    import kernels.cache_ops as co
    import kernels.fused_ops as fo
    import kernels.paged_attention as pa

    arms: dict[str, dict[str, ModuleType]] = {"new": dict(paged_attention=pa, fused_ops=fo, cache_ops=co)}
    if args.base is not None:
        arms["old"] = {
            m: _load(args.base / f"{m}.py", f"_base_{m}") for m in ("paged_attention", "fused_ops", "cache_ops")
        }
    started = time.monotonic()
    result: dict[str, Any] = {
        **run_header(
            "small_kernels",
            _without_notes(sys.argv[1:] if argv is None else argv),
            gpu,
            "bench_rotating over 32 layers' own buffers, us per layer" if gpu else "CPU dry run",
        ),
        "shape": dict(hidden=HIDDEN, q_heads=HQ, kv_heads=HKV, head_dim=D, intermediate=INTER, block_size=BLOCK),
        "context": CTX,
        "max_seq_len": MAX_LEN,
        "notes": args.notes,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"small-kernels-{device_slug(gpu)}-{result['date']}{args.tag}.json"
    kernels_rows: list[dict[str, Any]] = []
    attention_rows: list[dict[str, Any]] = []
    layer_rows: list[dict[str, Any]] = []
    checks: dict[str, float] = {}

    def save() -> None:
        result.update(kernels=kernels_rows, attention=attention_rows, layer=layer_rows, checks=checks)
        result["seconds"] = round(time.monotonic() - started, 1)
        path.write_text(json.dumps(result, indent=2) + "\n")

    batches = [1, 8, 32, 256] if gpu else [1]
    for batch in batches:
        n = (8 if batch >= 256 else 32) if gpu else 2
        L = Layers(batch, n, device, max_len=MAX_LEN if gpu else 64, ctx=CTX if gpu else 37)
        # correctness of the new arm against the old one, on layer 0's attention (same cache, same inputs)
        if "old" in arms:
            new_ops, old_ops = _ops(arms["new"], L), _ops(arms["old"], L)
            old_ops["attention"](0)
            ref = L.out[0].clone()
            new_ops["attention"](0)
            checks[f"attention_b{batch}_maxabs"] = float((L.out[0].float() - ref.float()).abs().max())
        for kind in ("norm", "rotary", "kv_write", "silu_mul", "attention"):
            row: dict[str, Any] = {"batch": batch, "kernel": kind}
            for arm, mods in arms.items():
                row[arm] = _time(_ops(mods, L)[kind], L, gpu)
            kernels_rows.append(row)
            save()
        # decode attention: every split count, and a few tiles of the one-tile split at a few sequences
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count if gpu else 4
        splits_list = [s for s in (1, 2, 4, 8, 16) if s * HKV * batch <= 16 * num_sms or s <= 2]
        for splits in splits_list:
            us = _time(_ops(arms["new"], L, dict(num_splits=splits))["attention"], L, gpu)
            attention_rows.append({"batch": batch, "splits": splits, "us": us})
            save()
        for splits, cfg in (
            (16, dict(BLOCK_N=64, num_warps=2, num_stages=3)),
            (16, dict(BLOCK_N=64, num_warps=4, num_stages=2)),
            (32, dict(BLOCK_N=32, num_warps=4, num_stages=2)),
        ):
            if batch > 8 or not gpu:
                break
            us = _time(_ops(arms["new"], L, dict(num_splits=splits, config=cfg))["attention"], L, gpu)
            attention_rows.append({"batch": batch, "splits": splits, "config": cfg, "us": us})
            save()
        for arm, mods in arms.items():
            chosen = (
                mods["paged_attention"].num_decode_splits(batch, HKV, L.max_len, device)
                if arm == "old"
                else pa.num_decode_splits(batch, HKV, L.max_len, device)
            )
            attention_rows.append(
                {"batch": batch, "arm": arm, "default_splits": chosen, "us": _time(_ops(mods, L)["attention"], L, gpu)}
            )
            layer_rows.append({"batch": batch, "arm": arm, "us": _time(_ops(mods, L)["layer"], L, gpu)})
            save()
        del L
        if gpu:
            torch.cuda.empty_cache()
    save()
    print(json.dumps({k: result[k] for k in ("kernels", "layer", "checks")}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
