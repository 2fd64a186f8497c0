"""How much a leaving engine's exit slows the CUDA calls of the engine that replaces it (issue 35).

A TP=4 restart's successor served 0.3 s after the old engine released its device memory, but its first CUDA graph
capture then took 3.8 s instead of 0.25 s, while the old engine's processes were still exiting.  This benchmark
finds which part of a leaving process's state makes its exit hold up another process's driver calls:

    python -m benchmarks.exit_contention [--pinned-gib 8] [--device-gib 20] [--ipc-gib 32] [--victims 4] --out DIR
    python -m benchmarks.exit_contention --quick --out DIR    # the CPU dry run of the protocol (no CUDA calls)

For each scenario, `--victims` child processes (the old engine's ranks) take their state, then are told to free what
a leaving engine frees before it says "released" (device memory) and to exit; meanwhile this process (the successor)
times, in a loop, a CUDA graph capture + instantiate + replay, a cudaMalloc/cudaFree of 256 MiB, a kernel launch +
sync, and a 16 MiB pinned allocation.  Each scenario reports the victims' allocation, release and exit times and,
per operation, the median before the exit and the median and the longest during it.  Scenarios:

    context   a CUDA context only
    device    --device-gib of device memory, freed before the exit (as release_for_successor does)
    ipc       --ipc-gib of this process's device memory opened through CUDA IPC (the keeper's weights), left open
    pinned    --pinned-gib of pinned host memory in 80 tensors (the swap space's layout), left to the exit
    pinned_freed  the same, unpinned by the process before its exit (timed on its own)
    registered    the same bytes as pageable memory of exactly the layers' size, pinned with cudaHostRegister
    registered_thp  the same in anonymous mappings advised to use transparent huge pages (2 MiB pages to unpin)
    engine    device + ipc + pinned, the device memory freed, the rest left to the exit (what an engine does today)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SCENARIOS = ("context", "device", "ipc", "pinned", "pinned_freed", "registered", "registered_thp", "engine")
SWAP_LAYERS = 80  # the 70B shape's layers: the swap space is one pinned tensor per layer
OPS = ("graph", "malloc", "launch", "pinned")


# -- the leaving process -------------------------------------------------------------------------------------------


def victim(scenario: str, pinned_gib: float, device_gib: float, handles_file: Path | None, quick: bool) -> None:
    """Take the scenario's state, say `ready <seconds>`; on `release` free what a leaving engine frees first, say
    `released <seconds>`; on `exit` leave at once (os._exit: the driver's teardown does the rest, as in an engine)."""
    import torch

    cuda = not quick
    started = time.monotonic()
    held: list[torch.Tensor] = []
    pinned: list[torch.Tensor] = []
    if cuda:
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the context
    if scenario in ("ipc", "engine") and handles_file is not None:
        import pickle

        from engine.keeper.arena import open_shared

        held_open = open_shared(pickle.loads(handles_file.read_bytes()), [])  # noqa: F841  # kept open until the exit
    if scenario in ("device", "engine"):
        n = int(device_gib * (1 << 30))
        held.append(torch.empty(n, dtype=torch.uint8, device="cuda" if cuda else "cpu"))
    if scenario in ("pinned", "pinned_freed", "engine"):
        per_layer = int(pinned_gib * (1 << 30)) // SWAP_LAYERS
        for _ in range(SWAP_LAYERS):
            pinned.append(torch.empty(per_layer, dtype=torch.uint8, pin_memory=cuda))
    if scenario in ("registered", "registered_thp"):
        pinned.extend(registered_layers(int(pinned_gib * (1 << 30)) // SWAP_LAYERS, scenario.endswith("thp"), cuda))
    print(f"ready {time.monotonic() - started:.3f}", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "release":
            t = time.monotonic()
            held.clear()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            if scenario == "pinned_freed":
                pinned.clear()
                if cuda:
                    torch._C._host_emptyCache()  # the caching host allocator gives the pinned pages back
            print(f"released {time.monotonic() - t:.3f}", flush=True)
        elif command == "exit":
            os._exit(0)


def registered_layers(nbytes: int, huge_pages: bool, cuda: bool) -> list[Any]:
    """SWAP_LAYERS buffers of `nbytes`, pageable memory pinned in place by cudaHostRegister (no rounding up)."""
    import mmap

    import torch

    out: list[Any] = []
    for _ in range(SWAP_LAYERS):
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages:
            region.madvise(mmap.MADV_HUGEPAGE)
        t = torch.frombuffer(region, dtype=torch.uint8)
        t.fill_(0)  # the pages exist before they are pinned
        if cuda:
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")
        out.append((region, t))
    return out


# -- the successor ---------------------------------------------------------------------------------------------------


class Probe:
    """Times the successor's driver calls in a loop on a thread of its own: (monotonic time, op, seconds)."""

    def __init__(self, quick: bool) -> None:
        import torch

        self.torch = torch
        self.quick = quick
        self.samples: list[tuple[float, str, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        if not quick:
            self.x = torch.ones(1 << 18, device="cuda")
            torch.cuda.synchronize()

    def _op(self, op: str) -> None:
        torch = self.torch
        if self.quick:
            sum(range(2000))
            return
        if op == "graph":
            g = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                with torch.cuda.graph(g, stream=stream):
                    y = self.x
                    for _ in range(40):
                        y = y * 1.0001 + 1.0
            g.replay()
            torch.cuda.synchronize()
            del g, y
        elif op == "malloc":
            t = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            del t
            torch.cuda.empty_cache()
        elif op == "launch":
            (self.x * 2.0).sum().item()
        elif op == "pinned":
            p = torch.empty(16 << 20, dtype=torch.uint8, pin_memory=True)
            del p
            torch._C._host_emptyCache()

    def _loop(self) -> None:
        while not self.stop.is_set():
            for op in OPS:
                t = time.monotonic()
                self._op(op)
                self.samples.append((t, op, time.monotonic() - t))

    def start(self) -> None:
        for op in OPS:  # first calls (lazy inits) outside the samples
            self._op(op)
        self.thread.start()

    def finish(self) -> list[tuple[float, str, float]]:
        self.stop.set()
        self.thread.join()
        return self.samples


def summarize(samples: list[tuple[float, str, float]], window: tuple[float, float]) -> dict[str, Any]:
    """Per op: the median before the window, the median and the longest of calls that overlapped it."""
    start, end = window
    out: dict[str, Any] = {}
    for op in OPS:
        before = [d for t, o, d in samples if o == op and t + d < start]
        during = [d for t, o, d in samples if o == op and t < end and t + d > start]
        out[op] = {
            "before_median_ms": round(statistics.median(before) * 1e3, 3) if before else None,
            "during_median_ms": round(statistics.median(during) * 1e3, 3) if during else None,
            "during_max_ms": round(max(during) * 1e3, 3) if during else None,
            "during_calls": len(during),
        }
    return out


def share_weights(gib: float, out: Path, quick: bool) -> tuple[Path | None, list[Any]]:
    """--ipc-gib of device memory in 8 storages (the keeper's arena), their CUDA IPC handles pickled to a file."""
    if quick or gib <= 0:
        return None, []
    import pickle

    import torch

    from engine.keeper.arena import share

    storages = [torch.empty(int(gib * (1 << 30)) // 8, dtype=torch.uint8, device="cuda") for _ in range(8)]
    handles, _fds = share(storages)
    path = out / "ipc-handles.pickle"
    path.write_bytes(pickle.dumps(handles))
    return path, storages


def run_scenario(scenario: str, args: argparse.Namespace, handles_file: Path | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.exit_contention", "--victim", scenario]
    if handles_file is not None:
        cmd += ["--handles", str(handles_file)]
    cmd += ["--pinned-gib", str(args.pinned_gib), "--device-gib", str(args.device_gib)]
    cmd += ["--quick"] if args.quick else []
    procs = [
        subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
        for _ in range(args.victims)
    ]
    ready = [float(p.stdout.readline().split()[1]) for p in procs]  # type: ignore[union-attr]
    probe = Probe(args.quick)
    probe.start()
    time.sleep(args.baseline_s)
    t_release = time.monotonic()
    for p in procs:
        p.stdin.write("release\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
    released = [float(p.stdout.readline().split()[1]) for p in procs]  # type: ignore[union-attr]
    t_exit = time.monotonic()
    for p in procs:
        p.stdin.write("exit\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
    exits = []
    for p in procs:
        p.wait()
        exits.append(time.monotonic() - t_exit)
    t_gone = time.monotonic()
    time.sleep(args.baseline_s)
    samples = probe.finish()
    return {
        "scenario": scenario,
        "victims": args.victims,
        "allocate_s": ready,
        "release_s": released,
        "release_window_s": round(t_exit - t_release, 3),
        "exit_s": [round(e, 3) for e in exits],
        "during_release": summarize(samples, (t_release, t_exit)),
        "during_exit": summarize(samples, (t_exit, t_gone)),
    }


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--victim", choices=SCENARIOS, help=argparse.SUPPRESS)
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--pinned-gib", type=float, default=8.0, help="pinned host memory per victim (the swap space)")
    p.add_argument("--device-gib", type=float, default=40.0, help="device memory per victim, all on GPU 0")
    p.add_argument("--handles", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--ipc-gib", type=float, default=32.0, help="device memory of this process each victim opens")
    p.add_argument("--victims", type=int, default=1, help="leaving processes at once (the old engine's ranks)")
    p.add_argument("--baseline-s", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="the protocol on the CPU, no CUDA call")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.victim:
        victim(args.victim, args.pinned_gib, args.device_gib, args.handles, args.quick)
        return 0
    if args.out is None:
        p.error("--out is required")
    if args.victims < 1 or args.pinned_gib < 0 or args.device_gib < 0:
        p.error("--victims must be >= 1 and the sizes >= 0")
    import torch

    if not args.quick and not torch.cuda.is_available():
        print("error: no CUDA device; use --quick for the CPU dry run", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "benchmark": "exit_contention",
        "command": "python -m benchmarks.exit_contention " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": dt.date.today().isoformat(),
        "gpu": "cpu" if args.quick else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "pinned_gib": args.pinned_gib,
        "device_gib": args.device_gib,
        "ipc_gib": args.ipc_gib,
        "transparent_hugepage": _read_text("/sys/kernel/mm/transparent_hugepage/enabled"),
        "victims": args.victims,
        "scenarios": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"exit-contention-{'cpu' if args.quick else 'gpu'}-{result['date']}.json"
    handles_file, _kept = share_weights(args.ipc_gib, args.out, args.quick)
    for scenario in args.scenarios:
        row = run_scenario(scenario, args, handles_file)
        result["scenarios"].append(row)
        path.write_text(json.dumps(result, indent=2) + "\n")
        ex = row["during_exit"]
        print(
            f"{scenario:13} exit {max(row['exit_s']):6.2f} s  graph {ex['graph']['before_median_ms']} -> "
            f"{ex['graph']['during_max_ms']} ms  malloc {ex['malloc']['before_median_ms']} -> "
            f"{ex['malloc']['during_max_ms']} ms  launch max {ex['launch']['during_max_ms']} ms  "
            f"pinned max {ex['pinned']['during_max_ms']} ms  (allocate {max(row['allocate_s']):.2f} s, "
            f"release {max(row['release_s']):.2f} s)",
            flush=True,
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
