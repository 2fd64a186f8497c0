"""Rank 0 of a tensor-parallel engine: its own runner, the workers it spawned, and their plans.

Why rank 0 lives in the engine process (and not in a worker like the others): the scheduler and
rank 0's runner then share one process, so the step pipeline is unchanged from one GPU: rank 0
queues step k+1 on its GPU while step k computes, reads its own sampled tokens from pinned memory,
and nothing crosses a process boundary on the way back.  The only per-step traffic is one pickled
plan (plain data: ids and counts, see engine/core/plan.py) written to each worker's pipe before
rank 0 launches the same plan; the collectives inside the forward keep the ranks in step.

Failure is loud and quick, never a hang: a watchdog thread waits on the workers' process handles,
and when one exits while the engine runs it logs the worker's one-line reason, prints it as the
last line on stderr, and ends the engine process with exit 1 (2 when the worker hit a ConfigError),
so that the supervisor restarts it.  rank 0 blocked inside an all-reduce is no obstacle: the
watchdog does not wait for it.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

import structlog
import torch

from engine.config import ConfigError, EngineConfig, ResolvedConfig
from engine.core.plan import DeviceSample, StepPlan, StepRunner
from engine.distributed.worker import WorkerArgs, reason_file
from engine.lifecycle import PROCESS_EXIT
from engine.logs import startup_detail
from engine.memory.budget import KVPlan
from engine.model.loader import ModelInfo
from engine.model.overlap import set_overlap_tokens
from engine.parallel.launch import COLLECTIVE_TIMEOUT, join_group, rank_device
from engine.parallel.peer_allreduce import checked_mode
from engine.runner.cuda_graphs import DecodeGraphs
from engine.runner.deferred import DeferredWork
from engine.runner.model_runner import ModelRunner
from engine.runner.piecewise import PiecewiseForward
from engine.runner.release import release_at_exit, release_for_successor
from engine.runner.startup import StartedRunner, start_runner

log = structlog.get_logger("pagekeeper.engine")

WORKER_STOP_S = 10.0
EXIT_NOW = ("exit",)  # to a worker: leave at once, no teardown (this process is exiting too)
GROUP_LEAVE_S = 15.0


class TensorParallelRunner:
    """Looks like a ModelRunner to the engine core (launch, graphs); fans each plan out first."""

    def __init__(self, config: ResolvedConfig, info: ModelInfo, defer: bool = False) -> None:
        from torch.distributed import TCPStore

        size = config.tensor_parallel_size
        self.size = size
        self.rank_plans: list[KVPlan] = []
        self._closing = False
        self._failed = threading.Lock()
        self._reasons = tempfile.mkdtemp(prefix="pagekeeper-tp-")
        self._wake_r, self._wake_w = os.pipe()
        device = rank_device(config, 0)
        checked_mode(device)  # a misspelt PAGEKEEPER_TP_ALLREDUCE, or require on the CPU: exit 2 before any spawn
        store = TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        self._pidfds: list[int] = []
        for rank in range(1, size):
            args = WorkerArgs(config, plain_info(info), rank, size, store.port, self._reasons, os.getpid(), defer)
            proc, conn = _spawn_worker(args)
            self._procs.append(proc)
            self._conns.append(conn)
            self._pidfds.append(os.pidfd_open(proc.pid))
        startup_detail(log, "tp_workers_started", size=size, pids=[p.pid for p in self._procs], device=str(device))
        threading.Thread(target=self._watch, daemon=True, name="tp-watchdog").start()
        atexit.register(self._close_at_exit)
        try:
            tp = join_group(store, 0, size, device, config.tensor_parallel_overlap_tokens)
            self.started: StartedRunner = start_runner(config, info, device, tp, self._agree, defer=defer)
            for rank, conn in enumerate(self._conns, start=1):
                kind, _ = self._recv(rank, conn)
                assert kind == "ready", kind
        except BaseException:
            self.close()
            raise
        self.local: ModelRunner = self.started.runner

    # -- start-up --------------------------------------------------------------------------------

    def _recv(self, rank: int, conn: Connection) -> Any:
        try:
            return conn.recv()
        except (EOFError, OSError):
            self._rank_failed(rank)

    def _agree(self, own: KVPlan) -> int:
        """Every rank's KV plan; all use the smallest block count."""
        plans: list[KVPlan] = [own] + [self._recv(rank, conn)[1] for rank, conn in enumerate(self._conns, start=1)]
        blocks: int = min(p.num_blocks for p in plans)
        for rank, conn in enumerate(self._conns, start=1):
            self._send(rank, conn, ("num_blocks", blocks))
        for p in plans:
            p.agreed_blocks = blocks
        self.rank_plans = plans
        return blocks

    def _send(self, rank: int, conn: Connection, obj: Any) -> None:
        try:
            conn.send(obj)
        except (BrokenPipeError, OSError):
            self._rank_failed(rank)

    # -- steps -------------------------------------------------------------------------------------

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.local.graphs

    @property
    def pieces(self) -> PiecewiseForward | None:
        return self.local.pieces

    @property
    def deferred(self) -> DeferredWork:
        return self.local.deferred

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.local.kv_caches

    def launch(self, plan: StepPlan, previous: DeviceSample | None = None) -> DeviceSample | None:
        self._broadcast((plan, previous is not None))
        return self.local.launch(plan, previous)

    def set_overlap_tokens(self, tokens: int) -> None:
        """Change --tensor-parallel-overlap-tokens on every rank from the next step on, so that a benchmark
        compares the overlapped and the plain steps on one engine (one start, one memory plan).  Start the
        engine with the overlap on (a threshold above every step keeps it idle): NCCL's stream priority is
        chosen when the group is created, and the start-up profile then measures the plain steps, whose
        activations are the larger."""
        set_overlap_tokens(self.local.model, tokens)  # checks it first
        self._broadcast(("overlap_tokens", tokens))

    def _broadcast(self, message: object) -> None:
        """`message` to every worker, in the order of the steps (each worker reads its pipe in order)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                self._rank_failed(rank)

    # -- failure and shutdown ------------------------------------------------------------------------

    def _watch(self) -> None:
        handles = {fd: rank for rank, fd in enumerate(self._pidfds, start=1)}
        ready = wait([*handles, self._wake_r])
        if self._closing:
            return
        for h in ready:
            if h in handles:
                self._rank_failed(handles[h])

    def _rank_failed(self, rank: int) -> NoReturn:
        """A worker is gone while the engine runs: say why in one line and end the engine now."""
        if self._closing:
            raise RuntimeError(f"tensor-parallel rank {rank} stopped while the engine was stopping")
        self._failed.acquire()  # the first reporter exits the process; any other waits here for that
        proc = self._procs[rank - 1]
        try:
            code: int | None = proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            code = None
        reason, config_error = None, False
        try:
            found = json.loads(reason_file(self._reasons, rank).read_text())
            reason, config_error = found["reason"], bool(found["config"])
        except (OSError, ValueError, KeyError):
            pass
        if reason is None:
            reason = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        exit_code = 2 if config_error else 1
        line = f"tensor-parallel rank {rank} (pid {proc.pid}) failed: {reason}; the engine stops (exit {exit_code})"
        log.error("tp_rank_failed", rank=rank, pid=proc.pid, reason=reason, exit_code=exit_code)
        sys.stderr.write(f"pagekeeper engine: {line}\n")
        sys.stderr.flush()
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        os._exit(exit_code)

    def _close_at_exit(self) -> None:
        self.close(process_exiting=PROCESS_EXIT.without_teardown)

    def close(self, process_exiting: bool = False) -> None:
        """Stop the workers (they finish the plan they run, then leave); safe to call twice.

        `process_exiting` (a server leaving through os._exit: engine/lifecycle.py PROCESS_EXIT): the workers exit at
        once and this process does not leave the NCCL group either, since the OS reclaims the communicators (an
        offline script's interpreter exit, which finalizes the group's objects, keeps the orderly leave).  The
        orderly leave took seconds at TP=4 (the 70B shape), and a restart's successor waits for this process's exit:
        it must come only after every rank's device memory is free, so the workers' exits are waited for."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self._close_at_exit)  # which also lets a closed engine's memory be freed
        os.write(self._wake_w, b"x")
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(EXIT_NOW if process_exiting else None))
            except (BrokenPipeError, OSError):
                pass
        local = getattr(self, "local", None)  # None: rank 0's start-up failed, so close() runs from __init__
        if process_exiting:
            if local is not None:  # while the workers free theirs (engine/runner/release.py)
                release_for_successor(local)
            self._wait_workers()
            return
        if local is not None:
            local.release_graphs()
            local.close()  # rank 0's pinned swap space (the workers' goes with their processes)
        # Every rank leaves the process group at the same time (NCCL's teardown waits for its peers);
        # a peer that is already gone must not hang the exit, so it is waited for only so long.
        leave = threading.Thread(target=_leave_group, daemon=True, name="tp-leave")
        leave.start()
        leave.join(GROUP_LEAVE_S)
        if leave.is_alive():
            # NCCL's teardown is stuck inside C++ (pytorch/pytorch#115388 and kin): the interpreter's
            # own exit would then abort.  Leave without it; the OS reclaims the communicators.
            log.warning("tp_group_leave_timeout", seconds=GROUP_LEAVE_S, effect="the process exits without it")
            atexit.register(_exit_without_teardown)
        self._wait_workers()

    def _wait_workers(self) -> None:
        for p in self._procs:
            try:
                p.wait(timeout=WORKER_STOP_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=WORKER_STOP_S)
        shutil.rmtree(self._reasons, ignore_errors=True)


def check_overlap_supported(config: EngineConfig | ResolvedConfig, info: ModelInfo) -> None:
    """--tensor-parallel-overlap-tokens on a model whose forward cannot split is refused, not ignored."""
    from engine.model.registry import ARCHITECTURES

    if config.tensor_parallel_overlap_tokens and not getattr(ARCHITECTURES[info.architecture], "SPLITS_STEPS", False):
        raise ConfigError(
            f"--tensor-parallel-overlap-tokens: {info.architecture} does not split its steps into micro-batches "
            "(the Llama family does); leave the flag out"
        )


def plain_info(info: ModelInfo) -> ModelInfo:
    """`info` with its HF config as a namespace of the config's own values (see WorkerArgs.info)."""
    return dataclasses.replace(info, hf_config=SimpleNamespace(**info.hf_config.to_dict()))


def _exit_without_teardown() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _leave_group() -> None:
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # shutting down: a broken group is no reason to fail the exit
        log.warning("tp_group_leave_failed", error=str(e))


def _spawn_worker(args: WorkerArgs) -> tuple[subprocess.Popen[bytes], Connection]:
    """`python -m engine.distributed.worker FD` with one end of a socket pair; sends it its WorkerArgs.

    Same process group as the engine (a stop of the group stops every rank), same environment
    (CUDA_VISIBLE_DEVICES, NCCL_* settings), and the engine's package first on its path."""
    ours, theirs = socket.socketpair()
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.distributed.worker", str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
        env=env,
        stdin=subprocess.DEVNULL,
    )
    theirs.close()
    conn = Connection(ours.detach())
    conn.send(args)
    return proc, conn


def start_engine_runner(
    config: ResolvedConfig, info: ModelInfo, defer: bool = False
) -> tuple[StartedRunner, StepRunner, list[KVPlan]]:
    """(the started rank-0 runner, the runner the core drives, every rank's KV plan); `defer`: see start_runner."""
    if config.tensor_parallel_size == 1:
        up = start_runner(config, info, rank_device(config, 0), defer=defer)
        release_at_exit(up.runner)  # a server's exit frees the GPU before its teardown (engine/runner/release.py)
        return up, up.runner, [up.kv_plan]
    check_overlap_supported(config, info)
    tp = TensorParallelRunner(config, info, defer)
    return tp.started, tp, tp.rank_plans
