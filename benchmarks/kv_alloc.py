"""How long a restart's KV cache takes to allocate and free: per layer in expandable segments, or one plain allocation.

A restart's successor allocates its KV cache the moment the old engine has freed its own, while the old processes
are still exiting.  This measures that moment on one GPU: an "old" process holds a KV-sized cache, frees it
(empty_cache) and exits; the "new" one allocates the same size at once.  Each mode also runs with no old process.

    python -m benchmarks.kv_alloc [--fraction 0.8] [--layers 80] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _allocate(mode: str, total: int, layers: int) -> list[Any]:
    import torch

    from engine.memory.kv_alloc import allocate_kv_caches

    per_layer = total // layers // 2
    if mode == "one_plain":
        return allocate_kv_caches((per_layer,), torch.bfloat16, torch.device("cuda"), layers)
    return [torch.zeros(per_layer, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]


def _old(mode: str, total: int, layers: int, held: Any, go: Any, released: Any) -> None:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    torch.cuda.init()
    caches = _allocate(mode, total, layers)
    torch.cuda.synchronize()
    held.set()
    go.wait()
    caches.clear()
    torch.cuda.empty_cache()
    released.set()
    os._exit(0)  # the driver's teardown of this context runs while the successor allocates


def _new(mode: str, total: int, layers: int, with_old: bool, out: Any) -> None:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    ctx = mp.get_context("spawn")
    old = None
    if with_old:
        held, go, released = ctx.Event(), ctx.Event(), ctx.Event()
        old = ctx.Process(target=_old, args=(mode, total, layers, held, go, released))
        old.start()
        held.wait()
        go.set()
        released.wait()
    started = time.monotonic()
    caches = _allocate(mode, total, layers)
    torch.cuda.synchronize()
    alloc_s = time.monotonic() - started
    started = time.monotonic()
    caches.clear()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    free_s = time.monotonic() - started
    if old is not None:
        old.join()
    out.put({"mode": mode, "with_old_process": with_old, "alloc_s": round(alloc_s, 3), "free_s": round(free_s, 3)})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fraction", type=float, default=0.8, help="of the device's free memory")
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    import torch

    free, total_mem = torch.cuda.mem_get_info()
    total = int(free * args.fraction) // (1 << 21) * (1 << 21)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    rows = []
    for _ in range(args.repeats):
        for with_old in (False, True):
            for mode in ("layers_expandable", "one_plain"):
                proc = ctx.Process(target=_new, args=(mode, total, args.layers, with_old, q))
                proc.start()
                rows.append(q.get(timeout=300))
                proc.join()
                print(json.dumps(rows[-1]), flush=True)
    result = {
        "benchmark": "kv_alloc",
        "command": "python -m benchmarks.kv_alloc " + f"--fraction {args.fraction} --layers {args.layers}",
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "bytes": total,
        "layers": args.layers,
        "rows": rows,
    }
    gpu = torch.cuda.get_device_name().split()[1].lower() if " " in torch.cuda.get_device_name() else "gpu"
    path = Path(args.out) / f"kv-alloc-{gpu}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
