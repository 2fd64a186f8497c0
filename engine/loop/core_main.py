"""The engine core's process: `python -m engine.loop --fd N`, started by its front (remote.py).

It builds the EngineCore the front's Start message describes, says Ready, then steps whenever it has work and
sends every step's token deltas with a snapshot of its state.  Idle, it still sends a snapshot every
IDLE_REPORT_S: a front that hears nothing for long knows the core hung.  It leaves when the front's end of the
socket closes (the front died or let it go), and on any error in a step: a device error leaves the device
unusable, and the front resumes every request on the next core.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import NoReturn

import structlog

from engine.config import ConfigError
from engine.core_share import CoreShare
from engine.cpu_threads import available_cores, bind_compute_thread, plan_cpu_threads
from engine.gc_heap import freeze_startup_heap, pause_startup_collections, resume_startup_collections
from engine.lifecycle import LIFECYCLE, PROCESS_EXIT
from engine.logs import configure_logging
from engine.loop.messages import (
    Admit,
    Fault,
    Finish,
    PhaseChanged,
    Ready,
    Recycle,
    Recycled,
    Refused,
    Start,
    Stepped,
    YieldCores,
)

log = structlog.get_logger("pagekeeper.core")

IDLE_REPORT_S = 0.25  # an idle core's snapshot interval: its heartbeat


class InjectedFault(RuntimeError):
    """The "fatal" test fault: what a step sees when the device fails under it."""


def leave(code: int) -> NoReturn:
    """Exit now: what registered for the exit runs (tensor-parallel workers stopped), nothing else is torn down."""
    PROCESS_EXIT.without_teardown = True
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class CoreProcess:
    def __init__(self, core: object, conn: Connection, share: CoreShare) -> None:
        from engine.core.engine_core import EngineCore
        from engine.kv.leak import KVLeak

        assert isinstance(core, EngineCore)
        self.core = core
        self.conn = conn
        self.leak = KVLeak(core.kv)
        self.share = share
        self.fatal_next_step = False
        self._last_report = 0.0

    def serve(self) -> NoReturn:
        from engine.core.request import RequestStatus

        core, conn = self.core, self.conn
        while True:
            busy = core.has_unfinished()
            wait = 0.0 if busy or core.has_deferred_work() else IDLE_REPORT_S
            try:
                if conn.poll(wait):
                    while True:
                        self.apply(conn.recv(), RequestStatus)
                        if not conn.poll(0):
                            break
            except (EOFError, OSError):
                log.info("core_leaving", reason="the front closed its end")
                leave(0)
            self.leak.step()
            self.share()
            if core.has_unfinished():
                if self.fatal_next_step:
                    raise InjectedFault("CUDA error: an illegal memory access was encountered (injected)")
                deltas = core.step()
                self._send(Stepped(deltas, core.snapshot(), self.leak.leaked))
            elif core.has_deferred_work():
                core.run_deferred()  # start-up work while idle: reported like idleness, so the front sees it pending
            if not busy and time.monotonic() - self._last_report >= IDLE_REPORT_S:
                self._send(Stepped([], core.snapshot(), self.leak.leaked))

    def apply(self, msg: object, statuses: type) -> None:
        if isinstance(msg, Admit):
            self.core.admit(msg.request_id, msg.valid, msg.arrival, msg.resumed)
        elif isinstance(msg, Finish):
            self.core.finish(msg.seq_id, statuses(msg.status), msg.stop_reason)
        elif isinstance(msg, Recycle):
            deltas, report = self.core.recycle()
            self._send(Recycled(deltas, report))
        elif isinstance(msg, YieldCores):
            self.share.yield_to_successor()
        elif isinstance(msg, Fault):
            log.warning("core_fault_injected", kind=msg.kind)
            if msg.kind == "exit":
                os.kill(os.getpid(), signal.SIGKILL)  # as kill -9 does: nothing runs
            elif msg.kind == "fatal":
                self.fatal_next_step = True
            elif msg.kind == "leak":
                self.leak.start(msg.blocks, msg.leave)

    def _send(self, msg: object) -> None:
        try:
            self.conn.send(msg)
        except OSError:
            log.info("core_leaving", reason="the front closed its end")
            leave(0)
        self._last_report = time.monotonic()


def die_with(front: int | None) -> None:
    """SIGKILL when the front dies (Linux's parent-death signal): a front killed by -9 must not leave a core holding
    the device that its successor's core needs.  A front that is already gone: leave now."""
    if front is None:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the socket's end still tells
    if os.getppid() != front:
        leave(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.loop")
    parser.add_argument("--fd", type=int, required=True, help="this end of the front's socket pair")
    parser.add_argument("--front", type=int, default=None, help="the front's pid: this process dies with it")
    parser.add_argument("--spare", action="store_true", help="a spare standing by behind the serving core (a label)")
    args = parser.parse_args(argv)
    pause_startup_collections()  # until the start-up heap is frozen, as the server does (engine/gc_heap.py)
    die_with(args.front)
    # The front decides when this process ends (it closes its end of the socket): a SIGTERM to the whole group
    # (systemd's stop, a terminal's ^C) is for the front, which drains first and needs its core meanwhile.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(args.fd)
    start = conn.recv()
    assert isinstance(start, Start), start
    configure_logging(start.log_level, force=True)
    import torch

    from engine.core.engine_core import EngineCore
    from engine.distributed.executor import start_engine_runner

    config = start.config
    # a standby start (engine/lifecycle.py: standby_until_exit) is the front's to report
    LIFECYCLE.listen(lambda old, new: conn.send(PhaseChanged(new.value)))
    try:
        plan = None
        if config.resolved_device() == "cpu" and config.tensor_parallel_size == 1:
            plan = plan_cpu_threads(available_cores(), start.cpu_reserved_cores)
            bind_compute_thread(plan)  # this process computes; its front keeps the serving cores
        share = CoreShare(torch.get_num_threads(), start.share_cores_with)
        share()
        core = EngineCore(config, start_engine_runner, defer_startup_work=True)
    except ConfigError as e:
        resume_startup_collections()
        conn.send(Refused(str(e)))
        return 2
    # the model, the KV pool and the imports live as long as this process: out of the collector's full passes
    log.info("core_ready", pid=os.getpid(), heap_frozen=freeze_startup_heap())
    try:
        conn.send(Ready(core.facts, os.getpid(), plan))
    except OSError:
        log.info("core_leaving", reason="the front closed its end")
        return 0
    try:
        CoreProcess(core, conn, share).serve()
    except Exception:  # a step's error: the device may be unusable; the front resumes on the next core
        log.exception("core_step_failed")
        return 1


if __name__ == "__main__":
    leave(main())
