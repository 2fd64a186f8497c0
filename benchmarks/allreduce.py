"""Measured all-reduce time and bandwidth between this host's GPUs (NCCL, symmetric memory), one process per GPU.

    python -m benchmarks.allreduce --tp 2 4 --sizes 2097152 134217728
    python -m benchmarks.allreduce --tp 2 --device cpu --sizes 65536     # gloo on the CPU (smoke run)

The tensor-parallel bounds (benchmarks/tp_bounds.py) charge each all-reduce a forward pass does the time measured
here for its size, so what is measured is the fastest this host does it, the way the engine does it: a round
of back-to-back all-reduces timed with CUDA events after every rank has synchronised (a lone all-reduce timed
per call also times the other ranks' late arrival, which made small messages look several times slower), the
fastest of several rounds, launched eagerly and replayed from a CUDA graph (as the engine's decode steps do);
the smaller of the two is `nccl_s`.  On CUDA the engine's symmetric-memory sum (engine/parallel/peer_allreduce.py,
the path PAGEKEEPER_TP_ALLREDUCE=auto takes up to its buffer's size) is timed the same way (`peer_s`), and
`seconds` is the faster of the two: what the bounds charge.  One spawn of max(tp) processes measures every
group size (ranks 0..tp-1 form each group).  Prints (and with --out writes) one JSON object: per group size,
per message size, the seconds, the algorithm bandwidth (bytes / time) and the bus bandwidth
(algbw x 2 (n - 1) / n, the per-link figure nccl-tests reports).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from engine.parallel.peer_allreduce import MAX_BYTES, PeerAllReduce

ROUNDS = 5
PEER_DEADLINE_S = 60.0  # each group size's symmetric-memory pass: a hang there must not cost the NCCL table
INIT_TIMEOUT = timedelta(seconds=120)


def ops_per_round(nbytes: int) -> int:
    """Enough back-to-back all-reduces that a round takes a millisecond or more, at most 50."""
    return max(10, min(50, (64 << 20) // max(nbytes, 1)))


def _time_round(fn: Any, ops: int, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / ops
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) / ops


def _measure_size(
    group: Any, nbytes: int, device: torch.device, dtype: torch.dtype, peer: PeerAllReduce | None = None
) -> dict[str, Any]:
    """NCCL's times for `nbytes` (eager_s, graph_s), or with `peer` the symmetric-memory path's instead."""
    import torch.distributed as dist

    x = torch.ones(max(1, nbytes // torch.empty((), dtype=dtype).element_size()), dtype=dtype, device=device)
    ops = ops_per_round(nbytes)

    def one() -> None:
        if peer is not None:
            peer.sum_(x)
        else:
            dist.all_reduce(x, group=group)

    def eager() -> None:
        for _ in range(ops):
            one()

    def sync() -> None:
        dist.all_reduce(torch.ones(1, device=device), group=group)  # every rank here before the round starts
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        one()
    row: dict[str, Any] = {"ops_per_round": ops}
    times = []
    for _ in range(ROUNDS):
        sync()
        times.append(_time_round(eager, ops, device))
    row["eager_s"] = min(times)
    if device.type == "cuda":
        try:
            graph = _capture(one, ops, device)
            times = []
            for _ in range(ROUNDS):
                sync()
                times.append(_time_round(graph.replay, ops, device))
            row["graph_s"] = min(times)
            del graph
        except Exception as e:  # a failed capture leaves the eager figure
            row["graph_error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return row


def _capture(step: Any, ops: int, device: torch.device) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        step()  # warm-up outside the graph, on a side stream, as torch.cuda.graphs recommends
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            step()
    torch.cuda.synchronize(device)
    return graph


def _rank(
    rank: int, world: int, store_path: str, tps: list[int], sizes: list[int], device_kind: str, out: str, pass_: str
) -> None:
    """One rank of one pass: "nccl" (NCCL's or gloo's times) or "peer" (the symmetric-memory sum's, CUDA only)."""
    import torch.distributed as dist

    if device_kind == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device(f"cuda:{rank}")
        dtype = torch.bfloat16
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=world, device_id=device, timeout=INIT_TIMEOUT
        )
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        device, dtype = torch.device("cpu"), torch.float32
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=INIT_TIMEOUT)
    results: dict[str, Any] = {}
    for tp in sorted(tps):
        group = None if tp == world else dist.new_group(list(range(tp)))  # every rank takes part in making it
        if rank < tp:
            rows: dict[str, Any] = {}
            if pass_ == "peer":
                peer, why = _peer(group, device, max(sizes))
                for nbytes in sizes:
                    if peer is None:
                        rows[str(nbytes)] = {"peer_error": why}
                        continue
                    fast = _measure_size(group, nbytes, device, dtype, peer)
                    rows[str(nbytes)] = {
                        "peer_eager_s": fast["eager_s"],
                        **({"peer_graph_s": fast["graph_s"]} if "graph_s" in fast else {}),
                        "peer_s": min(fast.get("graph_s", math.inf), fast["eager_s"]),
                    }
                    if rank == 0:
                        print(f"peer tp={tp} {nbytes} B: {rows[str(nbytes)]['peer_s'] * 1e6:.1f} us", flush=True)
            else:
                for nbytes in sizes:
                    row = {k: v for k, v in _measure_size(group, nbytes, device, dtype).items() if k != "ops_per_round"}
                    rows[str(nbytes)] = {"nccl_s": min(row.get("graph_s", math.inf), row["eager_s"]), **row}
            results[str(tp)] = rows
        dist.barrier(group=None, device_ids=[rank] if device_kind == "cuda" else None)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _peer(group: Any, device: torch.device, max_bytes: int) -> tuple[PeerAllReduce | None, str | None]:
    """The engine's symmetric-memory sum for this group, with a buffer for the largest size (a collective)."""
    import torch.distributed as dist

    from engine.parallel import peer_allreduce

    try:
        peer: PeerAllReduce | None = PeerAllReduce.set_up(group, device, max_bytes)
        why = None
    except Exception as e:  # noqa: BLE001 - the NCCL figures stand alone, the file says why
        peer, why = None, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    if not peer_allreduce._all_ranks(peer is not None, group, device):
        return None, why or "another rank's symmetric memory did not set up"
    assert peer is not None
    peer.check(group, device)
    dist.barrier(group=group, device_ids=[device.index])
    return peer, None


def measure(
    tps: list[int] | int, sizes: list[int], device: str = "cuda", peer_deadline_s: float = PEER_DEADLINE_S
) -> dict[str, Any]:
    """{str(tp): {str(size in bytes): {seconds, algbw_GBps, busbw_GBps, nccl_s, eager_s, graph_s, peer_s...}}} for
    each group size (one int: that group size's table alone).  NCCL's pass first; on CUDA then the
    symmetric-memory sum's, for the sizes up to its engine buffer, one group size per spawn of processes of their
    own, stopped past `peer_deadline_s` (the file then says so in `peer_error`): a failure there never costs the
    NCCL table."""
    single = isinstance(tps, int)
    groups = [tps] if isinstance(tps, int) else sorted(set(tps))
    sizes = sorted(set(sizes))
    result = _spawn_pass("nccl", groups, sizes, device, None)
    assert result is not None
    small = [n for n in sizes if n <= MAX_BYTES]
    for tp in groups if device == "cuda" and small else []:
        # one group size per spawn, as the engine has one group per process (engine/parallel/peer_allreduce.py:
        # a second set-up in a process, after a sub-group's, hung)
        try:
            fast = _spawn_pass("peer", [tp], small, device, peer_deadline_s)
        except Exception as e:  # noqa: BLE001 - the NCCL table stands; the file says why the other is missing
            fast, why = None, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
        else:
            why = None if fast is not None else f"stopped after {peer_deadline_s:.0f} s"
        for nbytes, row in result[str(tp)].items():
            extra = (fast or {}).get(str(tp), {}).get(nbytes)
            if extra is not None:
                row.update(extra)
            elif int(nbytes) <= MAX_BYTES:
                row["peer_error"] = why or "not measured"
    for tp, rows in result.items():
        for nbytes, row in rows.items():
            t = min(row["nccl_s"], row.get("peer_s", math.inf))
            algbw = int(nbytes) / t
            n = int(tp)
            rows[nbytes] = {
                "seconds": t,
                "algbw_GBps": round(algbw / 1e9, 2),
                "busbw_GBps": round(algbw * 2 * (n - 1) / n / 1e9, 2),
                **row,
            }
    return result[str(groups[0])] if single else result


def _spawn_pass(
    pass_: str, groups: list[int], sizes: list[int], device: str, deadline_s: float | None
) -> dict[str, Any] | None:
    """One pass in max(groups) fresh processes; None when it did not finish within `deadline_s` (killed)."""
    import torch.multiprocessing as mp

    world = max(groups)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        ctx = mp.start_processes(
            _rank,
            args=(world, os.path.join(d, "store"), groups, sizes, device, out, pass_),
            nprocs=world,
            start_method="spawn",
            join=False,
        )
        assert ctx is not None
        end = None if deadline_s is None else time.monotonic() + deadline_s
        while not ctx.join(timeout=5):
            if end is not None and time.monotonic() > end:
                for proc in ctx.processes:
                    proc.kill()
                for proc in ctx.processes:
                    proc.join()
                return None
        found: dict[str, Any] = json.loads(Path(out).read_text())
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[2])
    p.add_argument("--sizes", type=int, nargs="+", default=[2 << 20, 128 << 20])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    if any(tp < 2 for tp in args.tp) or any(s < 1 for s in args.sizes):
        p.error("--tp takes group sizes >= 2 and --sizes byte counts >= 1")
    if args.device == "cuda" and torch.cuda.device_count() < max(args.tp):
        print(f"benchmarks.allreduce needs {max(args.tp)} CUDA GPUs", file=sys.stderr)
        return 2
    result = measure(args.tp, args.sizes, args.device)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
