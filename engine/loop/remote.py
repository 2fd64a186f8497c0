"""The front's handle on an engine core in another process: what engine/loop/llm_engine.py's `Core` asks, by message.

It starts the core (`python -m engine.loop`, a socket pair between the two), forwards admissions and ends,
and turns the core's Stepped messages into the deltas `LLMEngine.step()` returns.  When the core ends — it exited,
was killed, or said nothing for `stall_s` (hung: then this kills it) — every request in flight is kept
(inflight.py), a new core is started, and once it is ready each request is handed to it again.  The step loop
never blocks on that: while a core starts, `step()` returns nothing and the server's heartbeat goes on.  A core
that ends `crash_limit` times within `crash_window_s` means something the next core will not fix: the front
then gives up (`on_give_up`, by default an exit with code 1, which the supervisor's crash-loop policy handles).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Callable

import structlog

from engine.config import ConfigError, EngineConfig
from engine.core.admission import ValidRequest
from engine.core.deltas import SeqDelta
from engine.core.facts import CoreFacts, RecycleReport
from engine.core.request import RequestStatus
from engine.cpu_threads import CpuThreadPlan
from engine.lifecycle import LIFECYCLE, Phase, descendants, wait_gone_or_released
from engine.loop.inflight import InFlight, Resumed
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
from engine.stats import EngineSnapshot

log = structlog.get_logger("pagekeeper.server")

# How long one step() waits for the core's next message, cut short by wake() (a request, an abort or a stop posted):
# the core sends one per step, so a busy loop iterates once per step.  It was 0.01 s with no wake: a loop that
# polled every 10 ms iterated twice per 16-ms decode step on a 2-core CPU and spent 0.8 ms of CPU per token beside
# the model's threads (docs/decisions/cpu-fused-ops.md, "The front's wait").
POLL_S = 0.1
# How long the idle loop waits for the core (whose idle reports come every 0.25 s), cut short by wake(): a front that
# polled every POLL_S while idle woke 100 times a second and kept 6 % of a core busy serving nothing.
IDLE_WAIT_S = 0.25
SPARE_SETTLE_MAX_S = 10.0  # a spare core starts at the latest this long after the serving one was ready
# counters of EngineSnapshot that a new core starts again from zero: the front adds the ended cores' totals
_COUNTERS = ("prefix_queries", "prefix_hits", "prompt_tokens", "generation_tokens", "preemptions", "steps")


@dataclass
class _Resuming:
    """The requests a core's end left waiting, until each has its first token from the next core."""

    reason: str
    waiting: set[str]
    seconds: list[float] = field(default_factory=list)

    def log(self) -> None:
        done = sorted(self.seconds)
        log.info(
            "requests_resumed",
            reason=self.reason,
            resumed=len(done),
            p50_s=round(statistics.median(done), 3) if done else None,
            max_s=round(done[-1], 3) if done else None,
            not_resumed=len(self.waiting),  # ended meanwhile (a client that left), or still waiting at a new end
        )


class CoreStartFailed(RuntimeError):
    """The first core ended before it was ready (its own log line says why)."""


def _leave(code: int) -> None:
    from engine.loop.core_main import leave

    leave(code)


class RemoteCore:
    def __init__(
        self,
        config: EngineConfig,
        *,
        log_level: str = "info",
        stall_s: float = 30.0,
        max_resumes: int = 3,
        resume_timeout_s: float = 300.0,
        crash_limit: int = 5,
        crash_window_s: float = 60.0,
        on_resumed: Callable[[Resumed], None] | None = None,
        on_core_ended: Callable[[str], None] | None = None,
        on_give_up: Callable[[int], None] = _leave,
        cpu_reserved_cores: int | None = None,
        share_cores_with: int | None = None,
        wait: bool = True,
        spare_core: bool = False,
    ) -> None:
        """Spawn the first core; with `wait`, return once it is ready (else call `wait_ready` before using it: the
        server spawns it first and builds its HTTP side while the core imports torch and loads the model)."""
        self.config = config
        self.cpu_reserved_cores = cpu_reserved_cores
        self.cpu_plan: CpuThreadPlan | None = None  # as the core chose it (Ready)
        self.share_cores_with = share_cores_with  # the first core only: a later one replaces no engine
        self.log_level = log_level
        self.stall_s = stall_s
        self.crash_limit = crash_limit
        self.crash_window_s = crash_window_s
        self.on_resumed = on_resumed
        self.on_core_ended = on_core_ended
        self.on_give_up = on_give_up
        self.inflight = InFlight(max_resumes)
        self.resume_timeout_s = resume_timeout_s
        self._send_lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()  # wake(): ends the loop's wait (idle or a step's) at once
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closing = False
        self.core_restarts = 0
        self._ends: deque[float] = deque()
        self._failed: list[tuple[str, str]] = []  # (request id, why) given up
        self._stash: list[SeqDelta] = []  # deltas read, not yet recorded
        self._out: list[SeqDelta] = []  # deltas recorded, for the next step()
        self._snapshot = EngineSnapshot()
        self._base = EngineSnapshot()  # the ended cores' counters
        self._facts: CoreFacts | None = None
        self._recycled: Recycled | None = None
        self._resuming: _Resuming | None = None
        self.pid: int | None = None
        self.spare_core = spare_core
        self._spare: tuple[subprocess.Popen[bytes], Connection] | None = None
        # A spare starts once the serving core has settled (its start-up work done), at the latest this long after
        # it was ready: a spare's start (imports, CUDA context, weights, warm-ups) took device time from the first
        # requests of the core it stands behind, whose graphs were still being captured.
        self._spare_due: float | None = None
        self._settled = False
        self._last_ready = 0.0
        self._spawn()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Until the first core is ready (the front needs its facts before it can validate anything); ConfigError
        when it refused its configuration, CoreStartFailed when it ended first."""
        while not self._ready:
            if self._dead:
                code = self._reap()
                raise CoreStartFailed(f"the engine core exited with code {code} before it was ready")
            self._wait_ready(1.0)

    # -- the core's process ---------------------------------------------------------------------

    def _start_process(self, config: EngineConfig, spare: bool = False) -> tuple[subprocess.Popen[bytes], Connection]:
        """A core's process and the front's end of its socket, its Start message sent."""
        front_end, core_end = socket.socketpair()
        fd = core_end.fileno()
        command = [sys.executable, "-m", "engine.loop", "--fd", str(fd), "--front", str(os.getpid())]
        proc = subprocess.Popen([*command, *(("--spare",) if spare else ())], pass_fds=(fd,))
        core_end.close()
        conn = Connection(front_end.detach())
        try:
            conn.send(Start(config, self.log_level, self.cpu_reserved_cores, self.share_cores_with))
        except (OSError, EOFError):
            pass  # it died at once: seen when it is read
        self.share_cores_with = None  # a later core replaces a core, not an engine: all the threads are its own
        return proc, conn

    def _spawn(self, after: int | None = None) -> None:
        """Start a core; `after`: the pid of the core it replaces, whose exit it waits for before it takes device
        memory (a standby start).  A spare standing by behind that core is promoted instead, when there is one."""
        if after is not None:
            self.config = dataclasses.replace(self.config, standby_after=after, standby_spare=False)
        spare, self._spare = self._spare, None
        promoted = spare is not None and spare[0].poll() is None
        if promoted:
            assert spare is not None
            self._proc, self._conn = spare
        else:
            if spare is not None:
                spare[1].close()
                log.warning("engine_core_spare_gone", pid=spare[0].pid, exit_code=spare[0].poll())
            self._proc, self._conn = self._start_process(self.config)
        self._ready = False
        self._dead = False
        self._spawned_at = time.monotonic()
        self._last_heard = self._spawned_at
        # the first core's start is the engine's own (its engine_ready and serving lines say it); a later one is news
        (log.info if self._facts is not None else log.debug)(
            "engine_core_starting", pid=self._proc.pid, in_flight=len(self.inflight), spare=promoted
        )

    def _spawn_spare(self) -> None:
        """A core that starts now as a standby of the serving one, without a time limit: imports, the CUDA context,
        the kept weights and the kernels' warm-ups done before it is needed, so that the serving core's end costs
        only the new KV cache and the first steps (engine/lifecycle.py: it takes device memory once the core it
        stands behind has exited or freed it).  A front that stops kills it first."""
        config = dataclasses.replace(self.config, standby_after=self._proc.pid, standby_spare=True)
        self._spare = self._start_process(config, spare=True)
        log.info(
            "engine_core_spare_started",
            pid=self._spare[0].pid,
            behind=self._proc.pid,
            after_ready_s=round(time.monotonic() - self._last_ready, 3),
            settled=self._settled,
        )

    def _wait_ready(self, timeout: float) -> None:
        try:
            if not self._conn.poll(timeout):
                return
            msg = self._conn.recv()
        except (EOFError, OSError):
            self._dead = True
            return
        if isinstance(msg, PhaseChanged):
            self._follow_phase(msg.phase)
            return
        if isinstance(msg, Refused):
            if self._facts is None:
                self._reap()
                raise ConfigError(msg.message)
            log.error("engine_core_refused", error=msg.message)
            self._dead = True
            return
        assert isinstance(msg, Ready), msg
        first = self._facts is None
        self._facts, self.pid, self.cpu_plan = msg.facts, msg.pid, msg.cpu_plan
        # Pending until the core's first report says (within IDLE_REPORT_S): the previous core's snapshot says
        # nothing of this one's start-up work, and a spare waits for it.
        self._snapshot = dataclasses.replace(self._snapshot, startup_work_pending=True)
        self._ready = True
        self._last_heard = self._last_ready = time.monotonic()
        admits = self.inflight.admits()
        for admit in admits:
            self._send(admit)
        log.info(
            "engine_core_ready",
            pid=msg.pid,
            seconds=round(self._last_heard - self._spawned_at, 3),
            resumed=0 if first else len(admits),
        )
        self._settled = False
        if self.spare_core and self._spare is None and not self._closing:
            self._spare_due = self._last_heard + SPARE_SETTLE_MAX_S

    def _spare_when_settled(self) -> None:
        due = self._spare_due
        if due is None or self._closing or not (self._settled or time.monotonic() >= due):
            return
        self._spare_due = None
        self._spawn_spare()

    @staticmethod
    def _follow_phase(phase: str) -> None:
        """The first core waits as a standby (its predecessor holds the device): so does the front, for the
        supervisor that asks it (engine/server/control.py)."""
        if phase == Phase.STANDBY.value and LIFECYCLE.phase == Phase.LOADING:
            LIFECYCLE.move(Phase.STANDBY)
        elif phase == Phase.LOADING.value and LIFECYCLE.phase == Phase.STANDBY:
            LIFECYCLE.move(Phase.LOADING)

    def _reap(self, proc: subprocess.Popen[bytes] | None = None) -> int:
        """The ended core's exit code (negative: the signal that killed it)."""
        proc = proc or self._proc
        try:
            return proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def _core_ended(self, why: str) -> None:
        """The core is gone (or hung: killed here).  The next one starts at once, as a standby of the old one's
        process (engine/lifecycle.py: it imports and sets up beside the dying process, and takes device memory
        only once that has exited), while this reaps the old one."""
        now = time.monotonic()
        old = self._proc
        if why == "hang":
            old.kill()
        self._conn.close()
        self._ends.append(now)
        while self._ends and now - self._ends[0] > self.crash_window_s:
            self._ends.popleft()
        crash_loop = len(self._ends) >= self.crash_limit
        if not self._closing and not crash_loop:
            self._spawn(after=old.pid)
        code = self._reap(old)
        reason = why if why == "hang" else "killed" if code < 0 else "error" if code else "exit"
        log.warning("engine_core_ended", reason=reason, exit_code=code, pid=old.pid, in_flight=len(self.inflight))
        if self.on_core_ended is not None:
            self.on_core_ended(reason)
        self.core_restarts += 1
        self._base = self._rebased(self._snapshot)
        self._snapshot = EngineSnapshot()
        if self._resuming is not None:
            self._resuming.log()
        given_up = self.inflight.pause(reason, now)
        self._resuming = _Resuming(reason, self.inflight.request_ids()) if self.inflight else None
        why = f"the engine core ended {self.inflight.max_resumes + 1} times while serving this request; retry it"
        self._failed.extend((request_id, why) for request_id in given_up)
        if crash_loop and not self._closing:
            log.error("engine_core_crash_loop", ends=len(self._ends), window_s=self.crash_window_s)
            self.on_give_up(1)

    def _send(self, msg: object) -> None:
        try:
            with self._send_lock:  # the step thread, and the control thread's YieldCores
                self._conn.send(msg)
        except (OSError, EOFError):
            self._dead = True  # seen by the next step

    def _pump(self, timeout: float) -> None:
        """Read what the core said within `timeout`; notice an end or a silence."""
        if self._dead:
            self._core_ended("exit")
            return
        if not self._ready:
            self._wait_ready(timeout)
            if self._dead:
                self._core_ended("exit")
            return
        try:
            if not self._conn.poll(timeout):
                if time.monotonic() - self._last_heard > self.stall_s:
                    log.error("engine_core_silent", seconds=round(time.monotonic() - self._last_heard, 1))
                    self._core_ended("hang")
                else:
                    self._spare_when_settled()
                return
            while True:
                msg = self._conn.recv()
                self._heard(msg)
                if not self._conn.poll(0):
                    break
        except (EOFError, OSError):
            self._core_ended("exit")
            return
        self._spare_when_settled()

    def _heard(self, msg: object) -> None:
        self._last_heard = time.monotonic()
        if isinstance(msg, Stepped):
            self._stash.extend(msg.deltas)
            self._snapshot = msg.snapshot
            self._settled = self._settled or not msg.snapshot.startup_work_pending
        elif isinstance(msg, Recycled):
            self._recycled = msg

    def _rebased(self, s: EngineSnapshot) -> EngineSnapshot:
        """`s` with the ended cores' counters added (a restart does not send the metrics' totals backwards)."""
        b = self._base
        gaps = b.token_gap_counts
        if s.token_gap_counts:
            gaps = tuple(x + y for x, y in zip(s.token_gap_counts, gaps)) if gaps else s.token_gap_counts
        return dataclasses.replace(
            s,
            **{name: getattr(s, name) + getattr(b, name) for name in _COUNTERS},
            token_gap_counts=gaps,
            token_gap_sum=s.token_gap_sum + b.token_gap_sum,
        )

    # -- what LLMEngine asks (engine/loop/llm_engine.py: Core) ----------------------------------------

    @property
    def facts(self) -> CoreFacts:
        assert self._facts is not None
        return self._facts

    def admit(
        self,
        request_id: str,
        valid: ValidRequest,
        arrival: float | None = None,
        resumed: dict[int, list[int]] | None = None,
    ) -> list[str]:
        arrival = time.monotonic() if arrival is None else arrival
        self.inflight.admitted(request_id, valid, arrival)
        if self._ready:
            self._send(Admit(request_id, valid, arrival))
        return [f"{request_id}#{i}" for i in range(valid.params.n)]

    def finish(self, seq_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> bool:
        self.inflight.ended(seq_id)
        if self._ready:
            self._send(Finish(seq_id, status.value, stop_reason))
        return True

    def step(self) -> list[SeqDelta]:
        self._await(POLL_S)
        self._collect(0)
        out, self._out = self._out, []
        return out

    def _collect(self, timeout: float) -> None:
        self._pump(timeout)
        if not self._ready:  # a core that takes too long to start: who waited past the limit is told to retry
            why = (
                f"no engine core took this request over within {self.resume_timeout_s:g} s (--resume-timeout); retry it"
            )
            self._failed.extend((rid, why) for rid in self.inflight.expired(time.monotonic(), self.resume_timeout_s))
        fresh, self._stash = self._stash, []
        for resumed in self.inflight.record(fresh, time.monotonic()):
            if self.on_resumed is not None:
                self.on_resumed(resumed)
            if self._resuming is not None and resumed.request_id in self._resuming.waiting:
                self._resuming.waiting.discard(resumed.request_id)
                self._resuming.seconds.append(resumed.seconds)
        if self._resuming is not None:
            self._resuming.waiting &= self.inflight.request_ids()
            if not self._resuming.waiting:
                self._resuming.log()
                self._resuming = None
        self._out.extend(fresh)

    def take_failed(self) -> list[tuple[str, str]]:
        """Requests given up since the last call, with why (resumed too often)."""
        failed, self._failed = self._failed, []
        return failed

    def has_unfinished(self) -> bool:
        return bool(self.inflight) or bool(self._out)

    def snapshot(self) -> EngineSnapshot:
        if not self._ready:  # a core starting: what waits for it is the backlog
            return dataclasses.replace(
                self._rebased(EngineSnapshot()), waiting=len(self.inflight), startup_work_pending=True
            )
        return self._rebased(self._snapshot)

    def recycle(self) -> tuple[list[SeqDelta], RecycleReport]:
        if not self._ready:
            raise RuntimeError("the engine core is starting: nothing to recycle")
        self._recycled = None
        self._send(Recycle())
        deadline = time.monotonic() + self.stall_s
        while self._recycled is None:
            if self._dead or not self._ready or time.monotonic() > deadline:
                raise RuntimeError("the engine core ended during the recycle (its requests are resumed)")
            self._pump(0.05)
        done, self._recycled = self._recycled, None
        return done.deltas, done.report

    def has_deferred_work(self) -> bool:
        """Always: the step loop must keep reading the core (its heartbeat, its end) while no request runs."""
        return True

    def run_deferred(self) -> None:
        """The idle loop: wait for the core's next message (the core runs its own deferred start-up work) or for
        `wake()`, at most IDLE_WAIT_S, then read what came."""
        self._await(IDLE_WAIT_S)
        self._collect(0)

    def _await(self, timeout: float) -> None:
        """Wait until the core says something or `wake()` is called, at most `timeout`; reads nothing."""
        if self._dead:
            return
        try:
            woken = wait([self._conn, self._wake_r], timeout)
        except (OSError, ValueError):  # the socket closed under the wait: seen by the read after
            woken = []
        if self._wake_r in woken:
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass

    def wake(self) -> None:
        """Thread-safe: end the loop's wait for the core now, idle or in a step (a request, an abort or a stop was
        posted)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:  # a wake already pending filled the buffer, or the core handle is closed
            pass

    def yield_cores(self) -> None:
        """Thread-safe enough for the control thread (one message): the core keeps half its threads."""
        self._send(YieldCores())

    def fault(self, kind: str, blocks: int = 0, leave: int = 0) -> None:
        """Test hook (engine/server/debug_hooks.py): what the core should suffer (messages.Fault)."""
        self._send(Fault(kind, blocks, leave))

    def close(self) -> None:
        """Let the core go: it leaves when its end of the socket closes; killed if it has not within 10 s.

        Waited for until it (and its tensor-parallel ranks) has exited or announced its device memory free
        (engine/runner/release.py), not for the driver's teardown of its exit: a restart's successor waits for this
        process, and at TP=4 that teardown took 5 s after the memory was free."""
        self._closing = True
        if self._spare is not None:  # before the core leaves: its standby would end, and it would take the device
            spare, self._spare = self._spare, None
            spare[0].kill()
            spare[1].close()
            # Reaped aside: the wait is the driver's teardown of its context (1.8 s at TP=4), and a spare standing by
            # has said it holds no device memory (engine/runner/release.py), so nobody needs its exit first.
            threading.Thread(target=spare[0].wait, name="spare-reaper", daemon=True).start()
        under = {self._proc.pid} | descendants(self._proc.pid)
        self._conn.close()
        try:
            wait_gone_or_released(under, time.monotonic() + 10.0)
        except TimeoutError:
            self._proc.kill()
            self._proc.wait()
        self._proc.poll()  # reaped if it has exited
        self._wake_r.close()
        self._wake_w.close()
