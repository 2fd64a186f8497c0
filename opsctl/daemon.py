"""The supervisor daemon's loop: observe the engine, decide with the policy, act through the launcher.

One loop thread does every poll and every action, so actions never overlap (a drain is never racing a
restart); commands from `opsctl` (opsctl/control_server.py) are queued to that same thread and run between
polls.  Every decision is logged as one structured event with its evidence and counted in the exporter
(opsctl/exporter.py); `status()` is what `opsctl status` shows (opsctl/status.py), and its engine state
is derived and checked in opsctl/state.py.

What runs the engine (a child process, a systemd unit) is the launcher's business (opsctl/launcher.py);
the process around this loop (lock, signals, wiring) is opsctl/supervisor.py.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from engine.config import ConfigError
from opsctl.config import PagekeeperConfig
from opsctl.constants import EXIT_PERMANENT, EXIT_SETTLE_S, RESTARTS_NAME, SUPERVISOR_LOG_NAME
from opsctl.exporter import SupervisorMetrics
from opsctl.exporter import serve as serve_metrics
from opsctl.launcher import Launcher, RestartFailed, Retired
from opsctl.logrotate import rotate_if_large
from opsctl.policy import Action, Observation, PolicyState, decide
from opsctl.probes import EngineProbe, EngineReading, GpuProbe, GpuReading, ProcessProbe, ProcessReading
from opsctl.runtime import write_last_failure, write_private
from opsctl.state import EngineState, StateTracker, derive
from opsctl.status import (
    CrashLoopStatus,
    Decision,
    EngineStatus,
    GpuStatus,
    RestartRecord,
    RestartsStatus,
    Status,
    SupervisorStatus,
)

log = structlog.get_logger("pagekeeper.supervisor")

RECYCLE_TIMEOUT_S = 30.0  # the engine recycles between two steps: a step, then milliseconds


@dataclass
class _Command:
    name: str
    args: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] = field(default_factory=dict)


def next_poll_at(due: float, interval: float, now: float) -> float:
    """When the poll after the one that was due at `due` starts.

    Polls keep the configured period, not period plus probe time: on a busy host a 1 s poll whose probes
    took 0.1 s ran every 1.1 s (CI's ten-minute soak counted 549 polls in about 620 s), and an operator
    who sets a 1 s poll reads its counts and alerts as once a second.  A poll that overran its period (a slow probe, an
    action: a drain, a restart) is followed by the next one at once, without a burst to catch up.
    """
    return max(due + interval, now)


class Supervisor:
    """Observe the engine, decide with the policy, act through the launcher; answer commands in between."""

    def __init__(self, cfg: PagekeeperConfig, launcher: Launcher, engine: EngineProbe, gpu: GpuProbe) -> None:
        self.cfg = cfg
        self.sup = cfg.supervisor
        self.policy_cfg = self.sup.policy()
        self.launcher = launcher
        self.engine = engine
        self.gpu = gpu
        self.process = ProcessProbe()
        self.history: deque[Observation] = deque(maxlen=self.sup.history_len())
        self.state = PolicyState(started_at=time.monotonic())
        self.started_wall = time.time()
        self.engine_started_wall = time.time()
        self.restart_log: list[RestartRecord] = []
        self.restarts_forgotten = 0  # restarts counted in the total whose records are no longer kept
        self.last_decision: Decision | None = None
        self.last_gpu: list[GpuReading] = []
        self.last_reading: dict[str, Any] = {}
        self.gave_up_reason: str | None = None
        self.failed_permanently = False
        self.ever_served = False
        self.exit_code = 0
        self.busy: EngineState | None = None  # the action in progress, for status
        self.tracker = StateTracker()
        self.commands: queue.Queue[_Command] = queue.Queue()
        self.stopping = False
        self.retired = False  # `opsctl retire` stopped the engine; nothing to poll until a restart or a stop
        self.last_tick = time.monotonic()  # the loop's heartbeat, for liveness()
        self.lock = threading.RLock()
        self.metrics = SupervisorMetrics(self)
        self.metrics.nvml.set(1 if gpu.available else 0)
        self.metrics.info.labels(_model_name(cfg), cfg.engine_url, launcher.name).set(1)
        self.metrics_port: int | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def serve_metrics(self) -> None:
        self.metrics_port = serve_metrics(
            self.metrics, self.sup.metrics_host, self.sup.metrics_port, liveness=self.liveness
        )

    def liveness(self) -> tuple[bool, str]:
        """Is this supervisor worth keeping?  A kubelet's liveness probe asks (/livez on the metrics port).

        Not when it gave up (the crash-loop guard, or an engine that exited 2 after serving): restarting the
        container, with the kubelet's back-off, is then the next level's job.  Not when its loop stopped
        ticking: a poll takes at most a few probe timeouts, and an action in progress (a drain, a restart that
        waits for the new engine to load) is bounded by drain_timeout + ready_timeout.  A sick engine is not a
        reason: the supervisor restarts it itself.
        """
        with self.lock:
            gave_up, reason, busy = self.state.gave_up, self.gave_up_reason, self.busy
        if gave_up:
            return False, f"gave up: {reason or 'crash loop'}"
        allowed = 3 * (self.sup.poll_interval + 2 * self.sup.probe_timeout) + 10
        if busy is not None:
            allowed += self.sup.drain_timeout + self.sup.ready_timeout
        stale = time.monotonic() - self.last_tick
        if stale > allowed:
            return False, f"the supervisor's loop has not run for {stale:.0f} s (allowed {allowed:.0f} s)"
        return True, "retired" if self.retired else "ok"

    def run(self) -> int:
        log.info(
            "supervisor_started",
            launcher=self.launcher.name,
            engine_url=self.cfg.engine_url,
            poll_interval=self.sup.poll_interval,
            dry_run=self.sup.dry_run,
            gpu=self.gpu.reason,
        )
        if self.launcher.alive():  # adopted from a predecessor: it has served already
            self.ever_served = True
            self._load_restarts()
        else:
            (self.sup.runtime_path() / RESTARTS_NAME).unlink(missing_ok=True)  # a new start counts from 0
            self._start_engine()
        due = time.monotonic()
        while not self.stopping:
            self.last_tick = time.monotonic()
            if not self.retired:
                self.poll_once()
            due = next_poll_at(due, self.sup.poll_interval, time.monotonic())
            self._wait_and_serve_commands(due - time.monotonic())
        self._refuse_queued_commands()
        log.info("supervisor_stopped", exit_code=self.exit_code)
        return self.exit_code

    def _refuse_queued_commands(self) -> None:
        """Commands that arrived after the stop are answered now, not left to their clients' timeouts."""
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
            cmd.reply = {"ok": False, "error": f"the supervisor stopped before it ran {cmd.name}"}
            cmd.done.set()

    def _wait_and_serve_commands(self, seconds: float) -> None:
        """Serve commands until the next poll is due; a starting engine that exits or starts serving meanwhile makes
        it due now (an engine that exits 2 on a bad setting is reported in a second, not at the next poll, seconds
        later; `opsctl start` returns as the engine serves, not up to a poll interval after)."""
        deadline = time.monotonic() + seconds
        watch = None  # only an engine that is starting and alive now: one already gone waits for the next poll
        if self.state.ready_at is None and not self.retired and not self.state.gave_up and self.launcher.exit_watch_s:
            watch = self.launcher.exit_watch_s if self.launcher.alive() else None
        while not self.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                cmd = self.commands.get(timeout=min(left, watch) if watch else left)
            except queue.Empty:
                if watch and (not self.launcher.alive() or self.launcher.serving_now()):
                    return
                continue
            self.last_tick = time.monotonic()
            try:
                cmd.reply = self._run_command(cmd)
            except Exception as e:  # a failed command must not kill the daemon; its reason is one line
                reason = " ".join(str(e).split()) or type(e).__name__
                log.error("command_failed", command=cmd.name, error=reason, error_type=type(e).__name__)
                cmd.reply = {"ok": False, "error": reason}
            if not self.stopping and not self.retired:
                self.history.append(self.observe())  # status right after a command is the new state
            cmd.done.set()

    # -- one poll -------------------------------------------------------------------------------

    def observe(self) -> Observation:
        sent = time.monotonic()  # an observation is dated when its probes were sent
        # The process is read before the launcher is asked: an engine that exits between the two reads is
        # then seen dead by the launcher too, which notes its exit code.  In the other order, the probe
        # could see it gone while the launcher had not yet reaped it, and an exit 2 was restarted.
        proc = self.process.read(self.launcher.pid())
        alive = self.launcher.alive()
        if alive and not proc.alive:
            alive = self._settle_exit()
        if not alive:
            proc = ProcessReading(alive=False)
        # Nothing answers HTTP while the engine starts (the held socket queues a probe until its timeout, which kept
        # this loop from seeing an engine that exited meanwhile for probe_timeout seconds): it is not probed then.
        loading = alive and self.state.ready_at is None and self.launcher.loading()
        reading: EngineReading | None = None
        if loading:
            reading = EngineReading(health="unreachable", health_detail="loading", metrics_error="engine loading")
        elif alive:
            reading = self.engine.read()
        if loading:
            pass
        elif reading is not None and reading.health == "draining":
            self.launcher.draining_on_its_own()  # remembers its deadline while it still says it
        elif reading is not None and reading.health in ("timeout", "unreachable"):
            if not self.launcher.alive():
                # It exited while the probe waited (an engine that drained on SIGTERM stops accepting first, so the
                # probe times out just before the exit): an exit, not a hang.
                alive, reading, proc = False, None, ProcessReading(alive=False)
            elif (why := self.launcher.draining_on_its_own()) is not None:
                # Told to stop by someone else (an operator's SIGTERM): it stopped accepting and is finishing what
                # it holds, within its own deadline.  Draining, not hung: its exit is restarted as an exit.
                reading = replace(reading, health="draining", health_detail=why)
        m = reading.metrics if reading else {}
        obs = Observation(
            t=sent,
            process_alive=alive and proc.alive,
            health=reading.health if reading else "unreachable",
            cache_usage=m.get("cache_usage"),
            running=m.get("running"),
            waiting=m.get("waiting"),
            steps_total=m.get("steps_total"),
            allocator_efficiency=m.get("allocator_efficiency"),
            oldest_waiting_s=m.get("oldest_waiting_s"),
            preemptions=m.get("preemptions"),
            metrics_error=reading.metrics_error if reading else "engine not running",
            exit_permanent=not alive and self.launcher.exit_is_permanent(),
        )
        gpu = self.gpu.read()
        with self.lock:
            self.last_gpu = gpu
            self.last_reading = {
                "health": obs.health,
                "health_detail": reading.health_detail if reading else "",
                "metrics": m,
                "metrics_error": obs.metrics_error,
                "model": reading.model_name if reading else None,
                "process": proc,
                "at": time.monotonic(),
            }
            self._refresh_state(alive)
        self.metrics.polls.inc()
        self.metrics.engine_up.set(1 if obs.health in ("ok", "draining") else 0)
        self.metrics.scrape_ok.set(0 if obs.metrics_error else 1)
        return obs

    def _settle_exit(self) -> bool:
        """The probe saw the process gone or a zombie while the launcher still holds it alive.

        An exiting process's main thread is a zombie while its other threads are still being torn down
        (CI caught one): waitpid does not report it yet, so its exit code is not known.  Wait for the
        launcher to reap it, so that the observation carries how it exited (an exit 2 is never retried).
        One whose threads do not finish within the bound is dead for serving and is reported so.
        """
        deadline = time.monotonic() + EXIT_SETTLE_S
        while time.monotonic() < deadline:
            if not self.launcher.alive():
                return False
            time.sleep(0.02)
        return self.launcher.alive()

    def poll_once(self) -> Action:
        obs = self.observe()
        self.history.append(obs)
        if self.state.ready_at is None and obs.health == "ok":
            with self.lock:
                self.state = replace(self.state, ready_at=obs.t)
                self.ever_served = True
                self._refresh_state(obs.process_alive)
            log.info("engine_ready", seconds_since_start=round(obs.t - self.state.started_at, 2))
        action = decide(list(self.history), self.state, self.policy_cfg, time.monotonic())
        self._record(action)
        self._rotate_logs()
        if action.acts and not self.sup.dry_run:
            self._execute(action)
        elif not self.sup.dry_run and not self.state.gave_up:
            self.launcher.maintain()  # a spare engine behind a serving one (opsctl/launcher.py)
        return action

    def _rotate_logs(self) -> None:
        """Keep the process launcher's log files under [supervisor] log_max_bytes (journald does it under systemd)."""
        paths = [self.launcher.log_path(), self.sup.runtime_path() / SUPERVISOR_LOG_NAME]
        for path in paths:
            if path is None:
                continue
            try:
                if rotate_if_large(path, self.sup.log_max_bytes, self.sup.log_backups):
                    self.metrics.log_rotations.labels(path.name).inc()
                    log.info(
                        "log_rotated", log=str(path), max_bytes=self.sup.log_max_bytes, backups=self.sup.log_backups
                    )
            except (OSError, ConfigError) as e:  # a full disk must not take the supervisor down
                log.warning("log_rotation_failed", log=str(path), error=str(e))

    def _record(self, action: Action) -> None:
        previous = self.last_decision
        entry = Decision(action.kind, action.reason, action.evidence, time.time(), self.sup.dry_run)
        with self.lock:
            self.last_decision = entry
        if action.acts:
            self.metrics.decisions.labels(action.kind, action.reason).inc()
            log.warning(
                "decision", action=action.kind, reason=action.reason, evidence=action.evidence, dry_run=self.sup.dry_run
            )
        elif previous is None or previous.reason != action.reason:
            log.info("decision", action=action.kind, reason=action.reason, evidence=action.evidence)

    # -- actions ----------------------------------------------------------------------------------

    def _execute(self, action: Action) -> None:
        if action.kind == "give_up":
            self._give_up(action)
            return
        if action.kind == "recycle" and self._recycle(action):
            return
        decided_at = time.time()
        timeout = self.sup.drain_timeout
        if action.drain_cap_s is not None and not self._overlap():
            timeout = min(timeout, action.drain_cap_s)  # one GPU: the old engine holds the memory its successor needs
        self._restart(
            action.reason,
            counts_as_crash=action.counts_as_crash,
            drain=action.drains,
            timeout=timeout,
            decided_at=decided_at,
        )

    def _recycle(self, action: Action) -> bool:
        """The cheap cure: rebuild the engine's KV pool in place.  False when it could not be done (the engine is
        not serving, or did not answer): the caller then restarts it, draining, as the policy's costlier cure."""
        self._set_busy(EngineState.RECYCLING)
        try:
            reply = self.launcher.recycle(RECYCLE_TIMEOUT_S)
            if reply is None:  # no private channel (systemd): the engine's admin route
                reply = self.engine.recycle(RECYCLE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any failure means: cure it the costlier way
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        finally:
            self._set_busy(None)
        if not reply.get("ok"):
            log.warning("recycle_failed", reason=action.reason, error=reply.get("error"), instead="drain_restart")
            return False
        now = time.monotonic()
        with self.lock:
            self.state = replace(self.state, recycled_at=now)
            self.history.clear()  # what comes after the cure is judged on its own
        self.metrics.recycles.labels(action.reason).inc()
        log.warning(
            "engine_recycled",
            reason=action.reason,
            requeued=reply.get("requeued"),
            reclaimed_blocks=reply.get("reclaimed_blocks"),
            usage_before=reply.get("usage_before"),
            seconds=reply.get("seconds"),
        )
        return True

    def _give_up(self, action: Action) -> None:
        permanent = action.permanent
        # an exit 2 is the engine naming a setting to fix: its own line, the one last_failure.json keeps too, so that
        # `opsctl start` says the same whether it sees this state or the supervisor's exit first
        detail = (self.launcher.exit_error() if permanent else None) or self.launcher.exit_summary() or action.reason
        with self.lock:
            self.state = replace(self.state, gave_up=True)
            self.gave_up_reason = detail
            self.failed_permanently = permanent
            self._refresh_state()
        self.metrics.gave_up.set(1)
        if permanent:
            log.error(
                "engine_failed_permanently",
                last_exit=detail,
                hint="exit code 2 is a mistake a person must fix (see the line above); it is not retried",
            )
        else:
            log.error(
                "crash_loop_gave_up",
                restarts=len(self.state.restarts),
                last_exit=detail,
                hint="fix the cause, then `opsctl restart`",
            )
        if permanent and not self.ever_served:
            # Nothing to supervise until a person changes something: say why (the engine's own line names the
            # setting) and leave.
            write_last_failure(self.sup.runtime_path(), self.launcher.exit_error() or detail)
            self.exit_code = EXIT_PERMANENT
            self.stopping = True

    def _count_lost(self, retired: Retired) -> None:
        for reason, count in retired.lost_by_reason.items():  # only reasons that cost something (Retired.of)
            self.metrics.lost.labels(reason).inc(count)
            log.warning("requests_lost", reason=reason, count=count)

    def _overlap(self) -> bool:
        return self.launcher.overlap

    def _restart(
        self, reason: str, counts_as_crash: bool, drain: bool, timeout: float, decided_at: float | None = None
    ) -> None:
        self._set_busy(EngineState.RESTARTING)
        log.warning("engine_restart", reason=reason, drain=drain, timeout_s=timeout)
        try:
            retired = self.launcher.restart(drain=drain, timeout=timeout, ready_timeout=self.sup.ready_timeout)
        except RestartFailed as e:
            log.error("restart_failed", reason=reason, error=str(e))
            self._set_busy(None)
            raise
        finally:
            self.launcher.forget_exit()
        self._count_lost(retired)
        now = time.monotonic()
        restarts = self.state.restarts + ((now,) if counts_as_crash else ())
        # Overlap: the new engine already serves (the launcher waited for it), so it is ready now.
        ready_at = now if retired.successor_serving else None
        with self.lock:
            self.state = PolicyState(started_at=now, ready_at=ready_at, restarts=restarts)
            self.history.clear()
            self.engine_started_wall = time.time()
            self.restart_log.append(RestartRecord(time.time(), decided_at or time.time(), reason, retired.lost))
            self._set_busy(None)
        self.metrics.restarts.labels(reason).inc()
        self.metrics.last_restart.set(time.time())
        self._save_restarts()

    # -- the restart count outlives this supervisor ----------------------------------------------

    KEPT_RESTART_RECORDS = 1000

    def _save_restarts(self) -> None:
        """The restarts so far, in the runtime dir: a supervisor that adopts this engine after this one died goes on
        counting (status, and the crash-loop guard's window) instead of starting from 0."""
        wall, mono = time.time(), time.monotonic()
        with self.lock:
            if len(self.restart_log) > self.KEPT_RESTART_RECORDS:  # the count is kept, not every record
                self.restarts_forgotten += len(self.restart_log) - self.KEPT_RESTART_RECORDS
                self.restart_log = self.restart_log[-self.KEPT_RESTART_RECORDS :]
            document = {
                "total": self.restarts_forgotten + len(self.restart_log),
                "records": [vars(r) for r in self.restart_log],
                "crash_loop": [wall - (mono - t) for t in self.state.restarts],  # wall clock: monotonic is per boot
            }
        try:
            write_private(self.sup.runtime_path() / RESTARTS_NAME, json.dumps(document))
        except (OSError, ConfigError) as e:  # a full disk must not fail a restart that happened
            log.warning("restarts_not_saved", error=str(e))

    def _load_restarts(self) -> None:
        try:
            document = json.loads((self.sup.runtime_path() / RESTARTS_NAME).read_text())
            records = [RestartRecord(**r) for r in document["records"]]
            total = int(document["total"])
            crashes = [float(t) for t in document["crash_loop"]]
        except (OSError, ValueError, KeyError, TypeError):
            return  # none saved (or unreadable): counting starts here
        wall, mono = time.time(), time.monotonic()
        window = [mono - (wall - t) for t in crashes if wall - t <= self.sup.restart_window]
        with self.lock:
            self.restart_log = records
            self.restarts_forgotten = max(0, total - len(records))
            self.state = replace(self.state, restarts=tuple(window))
        if records:
            self.metrics.last_restart.set(records[-1].time)
        log.info("restarts_carried_over", total=total, counted_for_crash_loop=len(window))

    def _start_engine(self) -> None:
        self.launcher.start()
        self.state = replace(self.state, started_at=time.monotonic())
        self.engine_started_wall = time.time()

    # -- commands (run on the loop thread) ------------------------------------------------------

    def submit(self, name: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        if name == "status":
            return {"ok": True, "status": self.status().to_json()}
        cmd = _Command(name, args)
        self.commands.put(cmd)
        if not cmd.done.wait(timeout):
            return {"ok": False, "error": f"{name} did not finish within {timeout:.0f} s; see `opsctl status`"}
        return cmd.reply

    def request_stop(self, engine: bool) -> None:
        """Queue a draining stop from a signal handler (where queue.put could deadlock on the queue's lock)."""
        stop = _Command("stop", {"drain": True, "engine": engine})
        threading.Thread(target=self.commands.put, args=(stop,)).start()

    def _run_command(self, cmd: _Command) -> dict[str, Any]:
        if cmd.args.get("drain_timeout") is not None and not self.launcher.drain_timeout_per_command:
            return {
                "ok": False,
                "error": "under systemd the engine drains for its own [engine] drain_timeout "
                "(bounded by TimeoutStopSec=); --drain-timeout cannot change it per command",
            }
        timeout = float(cmd.args.get("drain_timeout") or self.sup.drain_timeout)
        if cmd.name == "drain":  # a load balancer's drain: the engine answers 503 until resumed
            wait = float(cmd.args["timeout"]) if cmd.args.get("timeout") is not None else timeout
            self._set_busy(EngineState.DRAINING)
            try:  # over the engine's control socket where there is one: no HTTP credential needed
                reply = self.launcher.admin("drain", wait + 15, timeout_s=wait)
                return {"ok": True, "drain": reply["drain"] if reply is not None else self.engine.drain(wait)}
            finally:
                self._set_busy(None)
        if cmd.name == "resume":
            reply = self.launcher.admin("resume", 15)
            return {"ok": True, "resume": reply["resume"] if reply is not None else self.engine.resume()}
        if cmd.name == "restart":
            with self.lock:  # one step from gave_up to restarting: status never sees the engine in between
                self.state = replace(self.state, gave_up=False)
                self.gave_up_reason = None
                self.failed_permanently = False
                self.retired = False
                self._set_busy(EngineState.RESTARTING)
            self.metrics.gave_up.set(0)
            try:
                self._restart("manual", counts_as_crash=False, drain=bool(cmd.args.get("drain", True)), timeout=timeout)
            except RestartFailed as e:
                return {"ok": False, "error": str(e)}
            return {"ok": True}
        if cmd.name == "retire":  # a pod's preStop: hand the traffic over, stop the engine, stay until stopped
            self._set_busy(EngineState.STOPPING)
            retired = self.launcher.stop(drain=bool(cmd.args.get("drain", True)), timeout=timeout)
            self._count_lost(retired)
            self.retired = True
            log.info("engine_retired", lost=retired.lost, detail="the supervisor stays until it is stopped")
            return {"ok": True, "lost": retired.lost}
        if cmd.name == "stop":
            self._set_busy(EngineState.STOPPING)
            if cmd.args.get("engine", True):
                retired = self.launcher.stop(drain=bool(cmd.args.get("drain", True)), timeout=timeout)
                self._count_lost(retired)
            self.stopping = True
            return {"ok": True}
        return {"ok": False, "error": f"unknown command {cmd.name!r}"}

    def _set_busy(self, action: EngineState | None) -> None:
        with self.lock:
            self.busy = action
            self._refresh_state()

    def _refresh_state(self, alive: bool | None = None) -> EngineState:
        """Derive the reported state from what changed (opsctl/state.py checks the transition)."""
        with self.lock:
            if alive is None:
                alive = self.launcher.alive()
            return self.tracker.update(
                derive(
                    gave_up=self.state.gave_up,
                    permanent=self.failed_permanently,
                    busy=self.busy,
                    alive=alive,
                    ready=self.state.ready_at is not None,
                    health=self.last_reading.get("health", "unknown"),
                )
            )

    def status(self) -> Status:
        with self.lock:
            reading = dict(self.last_reading)
            metrics = reading.get("metrics", {})
            alive = self.launcher.alive()
            health = reading.get("health", "unknown")
            state = self._refresh_state(alive)

            def count(key: str) -> int | None:
                value = metrics.get(key)
                return int(value) if value is not None else None

            log_path = self.launcher.log_path()
            return Status(
                engine=EngineStatus(
                    state=state,
                    health=health,
                    health_detail=reading.get("health_detail"),
                    pid=self.launcher.pid() if alive else None,
                    uptime_s=round(time.time() - self.engine_started_wall, 1) if alive else None,
                    url=self.cfg.engine_url,
                    model=reading.get("model"),
                    kv_cache_usage=metrics.get("cache_usage"),
                    running=count("running"),
                    waiting=count("waiting"),
                    oldest_waiting_s=metrics.get("oldest_waiting_s"),
                    steps_total=count("steps_total"),
                    metrics_error=reading.get("metrics_error"),
                    process=reading.get("process"),
                    last_exit=self.launcher.exit_summary(),
                    readings_age_s=round(time.monotonic() - reading["at"], 1) if "at" in reading else None,
                    core_restarts=count("core_restarts"),
                    requests_resumed=count("requests_resumed"),
                ),
                gpu=GpuStatus(self.gpu.available, self.gpu.reason, list(self.last_gpu)),
                last_decision=self.last_decision,
                restarts=RestartsStatus(
                    total=self.restarts_forgotten + len(self.restart_log),
                    recent=self.restart_log[-10:],
                    counted_for_crash_loop=len(self.state.restarts),
                ),
                crash_loop=CrashLoopStatus(
                    gave_up=self.state.gave_up,
                    reason=self.gave_up_reason,
                    permanent=self.failed_permanently,
                    max_restarts=self.sup.max_restarts,
                    restart_window_s=self.sup.restart_window,
                ),
                supervisor=SupervisorStatus(
                    pid=os.getpid(),
                    launcher=self.launcher.name,
                    dry_run=self.sup.dry_run,
                    uptime_s=round(time.time() - self.started_wall, 1),
                    metrics_url=f"http://{self.sup.metrics_host}:{self.metrics_port}/metrics",
                    config=self.cfg.source,
                    instance=self.sup.instance,
                    runtime_dir=str(self.sup.runtime_path()),
                    poll_interval_s=self.sup.poll_interval,
                    handover=self.launcher.handover_mode,
                    weights_keeper=self.launcher.keeper_status(),
                    spare_engine=self.launcher.spare_status(),
                ),
                engine_log=str(log_path) if log_path else None,
            )


def _model_name(cfg: PagekeeperConfig) -> str:
    """The served model name the engine will report, as its metrics' model_name label."""
    from engine.config import EngineConfig

    known = {k: v for k, v in cfg.engine.items() if k in ("model", "served_model_name")}
    return EngineConfig(**known).model_name()
