"""Decode attention over a batch of long-tailed context lengths, by split count (GPU).

    python -m benchmarks.decode_long_tailed [--batches 32 80 160 256] [--out DIR]

The kernels benchmark times decode at one context length per batch; a serving batch mixes a few long
contexts with many short ones (the throughput benchmark's long-tailed run: median 77 decodes per step,
contexts from a few dozen to 3,072 tokens).  One program per (sequence, KV head) then waits on its longest
sequences: the split count chosen from the batch size alone (`num_decode_splits`) may leave the GPU idle
behind a tail.  This times the decode kernel (CUDA graph, cold L2, as a captured decode step runs it) at
each split count over lognormal contexts, against the bytes it must read at the measured copy bandwidth.
JSON: `<out>/decode-long-tailed-<gpu>-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import random
import sys
from pathlib import Path

import torch

from benchmarks.kernels import DEVICE, DTYPE, HKV, HQ, D, _bench, copy_tbps, gpu_slug
from benchmarks.throughput import RESULTS


def contexts(batch: int, seed: int, median: int = 500, sigma: float = 1.0, cap: int = 3072) -> list[int]:
    rng = random.Random(seed)
    return [max(16, min(cap, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(batch)]


def row(batch: int, lens: list[int], block_size: int, splits: list[int], copy: float, max_len: int) -> dict:
    from kernels import paged_attention as pa

    g = torch.Generator(device=DEVICE).manual_seed(batch)
    per_seq = [-(-n // block_size) for n in lens]
    pool = sum(per_seq) + 16
    width = -(-max_len // block_size)
    cache = torch.randn(2, pool, HKV, block_size, D, generator=g, device=DEVICE, dtype=DTYPE)
    perm = torch.randperm(pool, generator=g, device=DEVICE).to(torch.int32)
    tables = torch.zeros(batch, width, dtype=torch.int32, device=DEVICE)
    at = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[at : at + n]
        at += n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, HQ, D, generator=g, device=DEVICE, dtype=DTYPE)
    scale = D**-0.5
    moved = 2 * sum(lens) * HKV * D * cache.element_size()
    ideal_ms = moved / (copy * 1e12) * 1e3
    ref = pa.paged_attention_decode(query, cache, tables, seq_lens, scale, max_len, num_splits=1)
    out = dict(
        batch=batch,
        context_median=sorted(lens)[batch // 2],
        context_max=max(lens),
        context_mean=round(sum(lens) / batch),
        heuristic_splits=pa.num_decode_splits(batch, HKV, max_len, query.device),
        ideal_ms=round(ideal_ms, 5),
        by_splits={},
    )
    for s in splits:
        got = pa.paged_attention_decode(query, cache, tables, seq_lens, scale, max_len, num_splits=s)
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        ms = _bench(lambda s=s: pa.paged_attention_decode(query, cache, tables, seq_lens, scale, max_len, num_splits=s))
        out["by_splits"][s] = dict(ms=round(ms, 5), pct_of_copy=round(100 * ideal_ms / ms, 1), rel_err=err)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[32, 80, 160, 256])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    p.add_argument("--max-len", type=int, default=3072, help="the engine's max_model_len (the graphs' max_seq_len)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--uniform", type=int, help="every context this long instead (the cost of splitting there)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.decode_long_tailed needs a CUDA GPU", file=sys.stderr)
        return 2
    copy = copy_tbps()
    rows = []
    for b in args.batches:
        lens = [args.uniform] * b if args.uniform else contexts(b, seed=b)
        r = row(b, lens, args.block_size, args.splits, copy, args.max_len)
        rows.append(r)
        print(json.dumps(r), flush=True)
    name = torch.cuda.get_device_name()
    result = dict(
        gpu=name,
        date=dt.date.today().isoformat(),
        command="python -m benchmarks.decode_long_tailed " + " ".join(sys.argv[1:] if argv is None else argv),
        copy_TBps=round(copy, 4),
        rows=rows,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    kind = f"uniform-{args.uniform}" if args.uniform else "long-tailed"
    path = args.out / f"decode-{kind}-{gpu_slug(name)}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
