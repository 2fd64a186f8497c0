"""Measured all-reduce time and bandwidth between the GPUs of this host (NCCL), one process per GPU.

    python -m benchmarks.allreduce --tp 2 --sizes 2097152 134217728

The tensor-parallel roofline (benchmarks/tensor_parallel.py) counts the time of the all-reduces a
forward pass does at the sizes it does them; this measures exactly that, with CUDA events, in bf16.
Prints one JSON object: per size, the median seconds, the algorithm bandwidth (bytes / time) and the
bus bandwidth (algbw x 2 (n - 1) / n, the per-link figure nccl-tests reports).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def _rank(rank: int, size: int, store_path: str, sizes: list[int], out: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}")
    store = dist.FileStore(store_path, size)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=size, device_id=device)
    results: dict[str, Any] = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
        for _ in range(5):
            dist.all_reduce(x)
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        t = statistics.median(times)
        algbw = nbytes / t
        results[str(nbytes)] = {
            "seconds": t,
            "algbw_GBps": round(algbw / 1e9, 1),
            "busbw_GBps": round(algbw * 2 * (size - 1) / size / 1e9, 1),
        }
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def measure(tp: int, sizes: list[int]) -> dict[str, Any]:
    """{size in bytes: {seconds, algbw_GBps, busbw_GBps}} for an all-reduce over `tp` GPUs."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        mp.start_processes(_rank, args=(tp, os.path.join(d, "store"), sizes, out), nprocs=tp, start_method="spawn")
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=[2 << 20, 128 << 20])
    args = p.parse_args(argv)
    print(json.dumps(measure(args.tp, args.sizes), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
