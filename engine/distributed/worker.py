"""A tensor-parallel rank other than 0: its shard of the model and of the KV cache, run plan by plan.

Rank 0 (the engine process) schedules; every other rank only follows.  Each step's plan arrives as
one pickled message on a pipe and the worker runs exactly what rank 0's runner runs: the same
`launch(plan, previous)`, so the all-reduces line up and a pending token (async scheduling) is taken
from the worker's own samples of the step before, which equal rank 0's (every rank samples from the
same gathered logits with the same seeds).  Nothing comes back per step: only rank 0's tokens are read.

A worker never outlives its engine, and never fails silently: an exception is written, as one line,
where rank 0's watchdog reads it, and the worker exits; rank 0 then stops the engine with that line.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from engine.config import ConfigError, ResolvedConfig
from engine.model.loader import ModelInfo

PARENT_POLL_S = 0.5


@dataclass
class WorkerArgs:
    config: ResolvedConfig  # as rank 0 resolved it
    # What rank 0 read from the checkpoint, its HF config as a plain namespace: a worker never imports
    # transformers (about 3 s of CPU per rank at every start).
    info: ModelInfo
    rank: int
    size: int
    store_port: int
    reasons_dir: str
    parent_pid: int
    defer: bool = False  # leave graph capture and warm-ups to after serving starts (engine/runner/deferred.py)


def reason_file(reasons_dir: str, rank: int) -> Path:
    return Path(reasons_dir) / f"rank{rank}.json"


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def main() -> None:
    """`python -m engine.distributed.worker FD`: FD is this worker's end of a socket pair with rank 0,
    whose first message is the WorkerArgs.  A plain module run, not multiprocessing's spawn, so the
    worker never imports the engine's own `__main__` (a user's script without a main guard)."""
    import sys

    conn = Connection(int(sys.argv[1]))
    try:
        args = conn.recv()
    except EOFError:
        os._exit(0)
    run_worker(args, conn)


def run_worker(args: WorkerArgs, conn: Connection) -> None:
    """Serve as one rank until rank 0 says stop (or goes away); never returns."""
    from engine.gc_heap import pause_startup_collections

    pause_startup_collections()  # until _serve freezes the start-up heap (engine/gc_heap.py)
    # Ctrl-C and systemd's SIGTERM reach the whole process group: only rank 0 decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True, name="parent-watch").start()
    try:
        _serve(args, conn)
    except EOFError:
        os._exit(0)  # rank 0 closed the pipe: it is gone or stopping, nothing to report
    except BaseException as e:
        _report(args, e)
        os._exit(2 if isinstance(e, ConfigError) else 1)
    os._exit(0)


def _exit_with_parent(parent_pid: int) -> None:
    """Rank 0 killed (SIGKILL, OOM killer): no message will come, so leave on our own."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def _report(args: WorkerArgs, e: BaseException) -> None:
    import structlog

    structlog.get_logger("pagekeeper.engine").error(
        "tp_rank_error", rank=args.rank, error=one_line(e), traceback=traceback.format_exc()
    )
    path = reason_file(args.reasons_dir, args.rank)
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"reason": one_line(e), "config": isinstance(e, ConfigError)}))
        tmp.replace(path)
    except OSError:
        pass  # rank 0 still reports the exit code


def _serve(args: WorkerArgs, conn: Connection) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import TCPStore

    from engine.core.plan import DeviceSample
    from engine.gc_heap import freeze_imported_heap, freeze_startup_heap
    from engine.logs import configure_logging
    from engine.memory.budget import KVPlan
    from engine.model.overlap import set_overlap_tokens
    from engine.parallel.launch import COLLECTIVE_TIMEOUT, join_group, rank_device
    from engine.runner.release import release_for_successor
    from engine.runner.startup import start_runner

    freeze_imported_heap()  # out of start-up's last collection (engine/gc_heap.py)

    configure_logging()
    config = args.config
    device = rank_device(config, args.rank)
    store = TCPStore("127.0.0.1", args.store_port, args.size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    tp = join_group(store, args.rank, args.size, device, config.tensor_parallel_overlap_tokens)
    info = args.info

    def agree(plan: KVPlan) -> int:
        conn.send(("kv_plan", plan))
        answer = conn.recv()
        if answer is None:  # rank 0 failed its own start-up and is stopping: it reports why
            raise EOFError
        return int(answer[1])

    up = start_runner(config, info, device, tp, agree, defer=args.defer)
    # a rank's full collection would stall every rank at the next all-reduce (engine/gc_heap.py)
    freeze_startup_heap()
    conn.send(("ready", up.graph_capture_seconds))
    runner = up.runner
    runner.reads_samples = False  # only rank 0's samples are read
    last: DeviceSample | None = None
    with torch.inference_mode():
        while True:
            message = pickle.loads(conn.recv_bytes())
            if message is None:
                break
            if message == ("exit",):  # rank 0's process is exiting (executor.EXIT_NOW): no teardown to wait for
                release_for_successor(runner)  # the successor need not wait for this exit (engine/runner/release.py)
                os._exit(0)
            if isinstance(message[0], str):  # ("overlap_tokens", n): rank 0's set_overlap_tokens, between steps
                set_overlap_tokens(runner.model, message[1])
                continue
            plan, use_previous = message
            last = runner.launch(plan, last if use_previous else None)
    del last
    runner.release_graphs()  # before leaving the group: NCCL's teardown waits for graphs that captured it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
