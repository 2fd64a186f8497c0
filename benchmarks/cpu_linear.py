"""The CPU linear layers' products by dtype and path, per layer of the peer benchmark's checkpoints.

    python3 -m benchmarks.cpu_linear [--sizes 512x8,1024x16] [--rows 1,8,64,256] [--threads N] [--block-kib K]
        [--out DIR]

For each layer of the random Llama checkpoints benchmarks/peer_vllm_cpu.py serves (QKV, output, gate+up, down, the
32k-vocabulary head) and each number of rows: float32 `F.linear` (MKL), the packed float32 product the engine gives
float32 layers (oneDNN), bf16 `F.linear` (torch's own bf16 path), and the product engine/model/cpu_packing.py gives
bf16 layers on this CPU ("packed" where oneDNN has the instructions, "widened" where it has not), median of timed
calls in one process.  `model_ms` sums each path over a whole checkpoint (its layers times the four projections,
plus the head): a decode step's linear work at that many sequences.  The CPU's model and its bf16
instructions are recorded: the paths' order differs between AVX2-only and AVX-512-bf16 CPUs.  `--block-kib` sets
the widened product's block (the engine's WIDEN_BLOCK_BYTES) to compare sizes.  Writes `<out>/cpu-linear-<date>.json`
(`-<K>kib` added when the block was set).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.cpu_pair_contention import cpu_model
from benchmarks.throughput import RESULTS
from engine.model import cpu_packing

VOCAB = 32000


def layer_shapes(hidden: int) -> dict[str, tuple[int, int]]:
    """(out, in) features of each linear layer of the peer checkpoint of this width (heads of 64, no GQA)."""
    inter = hidden * 11 // 4
    return {
        "qkv": (3 * hidden, hidden),
        "o": (hidden, hidden),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (VOCAB, hidden),
    }


def bf16_flags() -> list[str]:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]


def _median_ms(call: Callable[[], Any], min_s: float) -> float:
    for _ in range(3):
        call()
    times: list[float] = []
    spent = 0.0
    while len(times) < 5 or spent < min_s:
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
        spent += times[-1]
    return round(statistics.median(times) * 1e3, 4)


def time_layer(out_f: int, in_f: int, rows: int, min_s: float) -> dict[str, float]:
    torch.manual_seed(0)
    w32 = torch.randn(out_f, in_f) * 0.05
    x32 = torch.randn(rows, in_f)
    w16, x16 = w32.bfloat16(), x32.bfloat16()
    product: dict[str, type[cpu_packing.Product]] = {
        "packed": cpu_packing._PackedProduct,
        "widened": cpu_packing._WidenedProduct,
    }
    kind = cpu_packing.product_kind(torch.bfloat16)
    timed = {"float32": _median_ms(lambda: F.linear(x32, w32), min_s)}
    if cpu_packing.product_kind(torch.float32) == "packed":
        packed32 = cpu_packing._PackedProduct(w32, None)
        timed["float32_packed"] = _median_ms(lambda: packed32(x32), min_s)
    timed["bf16_plain"] = _median_ms(lambda: F.linear(x16, w16), min_s)
    if kind is not None:
        fast = product[kind](w16, None)
        timed[f"bf16_{kind}"] = _median_ms(lambda: fast(x16), min_s)
    return timed


def model_totals(table: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Each path's time summed over one checkpoint per number of rows: its layers times the four projections, plus
    the head (`size` is HIDDENxLAYERS)."""
    totals: dict[str, dict[str, dict[str, float]]] = {}
    for row in table:
        times = {k: v for k, v in row.items() if k not in ("size", "layer", "out", "in", "rows")}
        count = 1 if row["layer"] == "lm_head" else int(row["size"].split("x")[1])
        cell = totals.setdefault(row["size"], {}).setdefault(str(row["rows"]), {})
        for path, ms in times.items():
            cell[path] = round(cell.get(path, 0.0) + count * ms, 4)
    return totals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="512x8,1024x16", help="hidden x layers, as the peer benchmark's checkpoints")
    ap.add_argument("--rows", default="1,8,64,256", help="rows per product (a decode step's sequences)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--min-seconds", type=float, default=0.2, help="timed calls per cell last at least this long")
    ap.add_argument(
        "--block-kib", type=int, default=None, help="the widened product's float32 block of W (default: the engine's)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.block_kib:
        cpu_packing.WIDEN_BLOCK_BYTES = args.block_kib << 10
    rows = [int(r) for r in args.rows.split(",")]
    table: list[dict[str, Any]] = []
    with torch.no_grad():
        for size in args.sizes.split(","):
            hidden = int(size.split("x")[0])
            for layer, (out_f, in_f) in layer_shapes(hidden).items():
                for m in rows:
                    row = {"size": size, "layer": layer, "out": out_f, "in": in_f, "rows": m}
                    row.update(time_layer(out_f, in_f, m, args.min_seconds))
                    table.append(row)
                    print(json.dumps(row), flush=True)
    result = {
        "date": dt.date.today().isoformat(),
        "command": "python3 -m benchmarks.cpu_linear " + " ".join(sys.argv[1:] if argv is None else argv),
        "cpu": cpu_model(),
        "bf16_instructions": bf16_flags(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "bf16_product": cpu_packing.product_kind(torch.bfloat16),
        "float32_product": cpu_packing.product_kind(torch.float32),
        "widen_block_bytes": cpu_packing.WIDEN_BLOCK_BYTES,
        "model_ms": model_totals(table),
        "ms": table,
    }
    for size, by_rows in result["model_ms"].items():
        for m, paths in by_rows.items():
            print(f"{size} rows={m}: " + ", ".join(f"{p} {v:.2f} ms" for p, v in paths.items()), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = f"-{args.block_kib}kib" if args.block_kib else ""
    path = args.out / f"cpu-linear-{result['date']}{suffix}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
