"""The supervisor daemon: observe the engine, decide with the policy, act through the launcher.

One loop thread does every poll and every action, so actions never overlap (a drain is never
racing a restart).  `opsctl` talks to the daemon over a unix socket (mode 0600, in the runtime
dir), one JSON request and one JSON reply per connection.  The daemon exports its own metrics
(`pagekeeper_supervisor_*`, and NVML readings as `pagekeeper_gpu_*`) and logs every decision as one
structured event with its evidence.

Restarts hand over, they never refuse (opsctl/launcher.py).  The supervisor's own death takes no one
down: the engine it started keeps serving on its listening socket, and the next supervisor for the
runtime dir (`opsctl start`) adopts that engine instead of starting a second one.  Only one supervisor
runs per runtime dir (an flock on supervisor.lock).  An engine that exits with code 2 (a mistake a
person must fix) is never restarted; if it never served, the supervisor exits 2 and leaves the reason
in last_failure.json for `opsctl start` and `opsctl status`.

    python -m opsctl.supervisor [--config FILE] [--runtime-dir DIR] [--dry-run]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import queue
import signal
import socketserver
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.config import ConfigError
from engine.logs import configure_logging
from engine.server.settings import read_secret
from engine.config_file import SECRET_ENV
from opsctl.config import PagekeeperConfig, load_config
from opsctl.instances import INSTANCE_FILE_NAME, InstanceRecord, port_clash, running_instances, write_record
from opsctl.logrotate import rotate_if_large
from opsctl.launcher import Launcher, ProcessLauncher, RestartFailed, SystemdLauncher, systemd_available
from opsctl.policy import EFFECTS, Action, Observation, PolicyState, decide
from opsctl.probes import EngineProbe, GpuProbe, GpuReading, ProcessProbe, gpu_probe
from opsctl.runtime import open_private, prepare_runtime_dir, write_private
from opsctl.state import EngineState, StateTracker, derive
from opsctl.status import (CrashLoopStatus, Decision, EngineStatus, GpuStatus, RestartRecord, RestartsStatus, Status,
                           SupervisorStatus)

log = structlog.get_logger("pagekeeper.supervisor")

SOCKET_NAME = "supervisor.sock"
PID_NAME = "supervisor.pid"
LOCK_NAME = "supervisor.lock"
LAST_FAILURE_NAME = "last_failure.json"
ENGINE_LOG_NAME = "engine.log"
SUPERVISOR_LOG_NAME = "supervisor.log"
EXIT_PERMANENT = 2  # the engine cannot start until a person fixes something
EXIT_ALREADY_RUNNING = 75  # another supervisor holds this runtime dir (EX_TEMPFAIL)


class _GpuCollector:
    """Exports the latest NVML readings at scrape time (values come from the last poll)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterator[Any]:
        readings: list[GpuReading] = self.supervisor.last_gpu
        fams = {
            "memory_used_bytes": GaugeMetricFamily("pagekeeper_gpu_memory_used_bytes", "GPU memory used (NVML)", labels=["gpu"]),
            "memory_total_bytes": GaugeMetricFamily("pagekeeper_gpu_memory_total_bytes", "GPU memory total (NVML)", labels=["gpu"]),
            "utilization_ratio": GaugeMetricFamily("pagekeeper_gpu_utilization_ratio", "GPU utilization 0-1 (NVML)", labels=["gpu"]),
            "temperature_celsius": GaugeMetricFamily("pagekeeper_gpu_temperature_celsius", "GPU temperature (NVML)", labels=["gpu"]),
        }
        xid = CounterMetricFamily("pagekeeper_gpu_xid_errors", "Critical XID events seen (NVML)", labels=["gpu"])
        ecc = CounterMetricFamily("pagekeeper_gpu_ecc_errors", "Uncorrected volatile ECC errors (NVML)", labels=["gpu"])
        for g in readings:
            if g.ecc_errors_total is not None:
                ecc.add_metric([str(g.index)], float(g.ecc_errors_total))
            for key, fam in fams.items():
                value = getattr(g, key)
                if value is not None:
                    fam.add_metric([str(g.index)], float(value))
            xid.add_metric([str(g.index)], float(g.xid_errors_total))
        yield from fams.values()
        yield xid
        yield ecc


# (action, reason) pairs the policy can decide (opsctl/policy.py).
ACTIONS = tuple((effect.kind, reason) for reason, effect in EFFECTS.items())
LOST_REASONS = ("engine_exited", "killed", "no_drain")


class SupervisorMetrics:
    def __init__(self, supervisor: Supervisor) -> None:
        self.registry = r = CollectorRegistry()
        self.engine_up = Gauge("pagekeeper_supervisor_engine_up", "1 while the engine answers /health", registry=r)
        self.restarts = Counter("pagekeeper_supervisor_restarts", "Engine restarts by the supervisor", ["reason"], registry=r)
        self.decisions = Counter("pagekeeper_supervisor_decisions", "Acting decisions (also in dry-run)",
                                 ["action", "reason"], registry=r)
        self.gave_up = Gauge("pagekeeper_supervisor_crash_loop_gave_up", "1 after the crash-loop guard gave up", registry=r)
        self.last_restart = Gauge("pagekeeper_supervisor_last_restart_timestamp_seconds", "Unix time of the last restart",
                                  registry=r)
        self.scrape_ok = Gauge("pagekeeper_supervisor_engine_metrics_ok", "1 when the last engine /metrics parsed", registry=r)
        self.nvml = Gauge("pagekeeper_supervisor_nvml_available", "1 when NVML readings are available", registry=r)
        self.polls = Counter("pagekeeper_supervisor_polls", "Polls of the engine", registry=r)
        self.lost = Counter("pagekeeper_supervisor_requests_lost", "Requests in flight that got no answer: the "
                            "engine died (engine_exited), was killed after its drain timeout (killed), or was "
                            "restarted with --no-drain (no_drain: answered with a clean 503)", ["reason"], registry=r)
        self.log_rotations = Counter("pagekeeper_supervisor_log_rotations", "Size-based rotations of the process "
                                     "launcher's logs ([supervisor] log_max_bytes)", ["log"], registry=r)
        self.info = Gauge("pagekeeper_supervisor_info", "The engine this supervisor runs (always 1)",
                          ["model_name", "engine_url", "launcher"], registry=r)
        # Every series exists from the start, so increase() sees the first restart of each kind.
        for action, reason in ACTIONS:
            self.decisions.labels(action, reason)
        for reason in {reason for kind, reason in ACTIONS if kind != "give_up"} | {"manual"}:
            self.restarts.labels(reason)
        for reason in LOST_REASONS:
            self.lost.labels(reason)
        for name in (ENGINE_LOG_NAME, SUPERVISOR_LOG_NAME):
            self.log_rotations.labels(name)
        r.register(_GpuCollector(supervisor))


@dataclass
class _Command:
    name: str
    args: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] = field(default_factory=dict)


class Supervisor:
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
        self.lock = threading.RLock()
        self.metrics = SupervisorMetrics(self)
        self.metrics.nvml.set(1 if gpu.available else 0)
        self.metrics.info.labels(_model_name(cfg), cfg.engine_url, launcher.name).set(1)
        self.metrics_port: int | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def serve_metrics(self) -> None:
        try:
            server, _ = start_http_server(self.sup.metrics_port, addr=self.sup.metrics_host,
                                          registry=self.metrics.registry)
        except OSError as e:
            raise ConfigError(f"[supervisor] metrics_port {self.sup.metrics_port} on {self.sup.metrics_host}: "
                              f"{e.strerror}; choose another port (0 = any free port)") from e
        self.metrics_port = server.server_port
        log.info("supervisor_metrics", url=f"http://{self.sup.metrics_host}:{self.metrics_port}/metrics")

    def run(self) -> int:
        log.info("supervisor_started", launcher=self.launcher.name, engine_url=self.cfg.engine_url,
                 poll_interval=self.sup.poll_interval, dry_run=self.sup.dry_run, gpu=self.gpu.reason)
        if self.launcher.alive():  # adopted from a predecessor: it has served already
            self.ever_served = True
        else:
            self._start_engine()
        while not self.stopping:
            self.poll_once()
            self._wait_and_serve_commands(self.sup.poll_interval)
        log.info("supervisor_stopped", exit_code=self.exit_code)
        return self.exit_code

    def _wait_and_serve_commands(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                cmd = self.commands.get(timeout=left)
            except queue.Empty:
                return
            try:
                cmd.reply = self._run_command(cmd)
            except Exception as e:  # a failed command must not kill the daemon
                log.exception("command_failed", command=cmd.name)
                cmd.reply = {"ok": False, "error": str(e)}
            if not self.stopping:
                self.history.append(self.observe())  # status right after a command is the new state
            cmd.done.set()

    # -- one poll -------------------------------------------------------------------------------

    def observe(self) -> Observation:
        sent = time.monotonic()  # an observation is dated when its probes were sent
        alive = self.launcher.alive()
        pid = self.launcher.pid()
        proc = self.process.read(pid if alive else None)
        reading = self.engine.read() if alive else None
        m = reading.metrics if reading else {}
        obs = Observation(
            t=sent, process_alive=alive and proc.alive, health=reading.health if reading else "unreachable",
            cache_usage=m.get("cache_usage"), running=m.get("running"), waiting=m.get("waiting"),
            steps_total=m.get("steps_total"), allocator_efficiency=m.get("allocator_efficiency"),
            oldest_waiting_s=m.get("oldest_waiting_s"), preemptions=m.get("preemptions"),
            metrics_error=reading.metrics_error if reading else "engine not running",
            exit_permanent=not alive and self.launcher.exit_is_permanent(),
        )
        gpu = self.gpu.read()
        with self.lock:
            self.last_gpu = gpu
            self.last_reading = {
                "health": obs.health, "health_detail": reading.health_detail if reading else "",
                "metrics": m, "metrics_error": obs.metrics_error,
                "model": reading.model_name if reading else None, "process": proc,
            }
            self._refresh_state(alive)
        self.metrics.polls.inc()
        self.metrics.engine_up.set(1 if obs.health in ("ok", "draining") else 0)
        self.metrics.scrape_ok.set(0 if obs.metrics_error else 1)
        return obs

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
                    log.info("log_rotated", log=str(path), max_bytes=self.sup.log_max_bytes,
                             backups=self.sup.log_backups)
            except (OSError, ConfigError) as e:  # a full disk must not take the supervisor down
                log.warning("log_rotation_failed", log=str(path), error=str(e))

    def _record(self, action: Action) -> None:
        previous = self.last_decision
        entry = Decision(action.kind, action.reason, action.evidence, time.time(), self.sup.dry_run)
        with self.lock:
            self.last_decision = entry
        if action.acts:
            self.metrics.decisions.labels(action.kind, action.reason).inc()
            log.warning("decision", action=action.kind, reason=action.reason, evidence=action.evidence,
                        dry_run=self.sup.dry_run)
        elif previous is None or previous.reason != action.reason:
            log.info("decision", action=action.kind, reason=action.reason, evidence=action.evidence)

    # -- actions ----------------------------------------------------------------------------------

    def _execute(self, action: Action) -> None:
        if action.kind == "give_up":
            self._give_up(action)
            return
        decided_at = time.time()
        timeout = self.sup.drain_timeout
        if action.drain_cap_s is not None and not self._overlap():
            timeout = min(timeout, action.drain_cap_s)  # one GPU: the old engine holds the memory its successor needs
        self._restart(action.reason, counts_as_crash=action.counts_as_crash,
                      drain=action.drains, timeout=timeout, decided_at=decided_at)

    def _give_up(self, action: Action) -> None:
        detail = self.launcher.exit_summary() or action.reason
        permanent = action.permanent
        with self.lock:
            self.state = replace(self.state, gave_up=True)
            self.gave_up_reason = detail
            self.failed_permanently = permanent
            self._refresh_state()
        self.metrics.gave_up.set(1)
        if permanent:
            log.error("engine_failed_permanently", last_exit=detail,
                      hint="exit code 2 is a mistake a person must fix (see the line above); it is not retried")
        else:
            log.error("crash_loop_gave_up", restarts=len(self.state.restarts), last_exit=detail,
                      hint="fix the cause, then `opsctl restart`")
        if permanent and not self.ever_served:
            # Nothing to supervise until a person changes something: say why and leave.
            write_last_failure(self.sup.runtime_path(), detail)
            self.exit_code = EXIT_PERMANENT
            self.stopping = True

    def _count_lost(self, reason: str, count: int) -> None:
        if count > 0:
            self.metrics.lost.labels(reason).inc(count)
            log.warning("requests_lost", reason=reason, count=count)

    def _overlap(self) -> bool:
        return self.launcher.overlap

    def _restart(self, reason: str, counts_as_crash: bool, drain: bool, timeout: float,
                 decided_at: float | None = None) -> None:
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
        self._count_lost(retired.reason, retired.lost)
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

    def _run_command(self, cmd: _Command) -> dict[str, Any]:
        if cmd.args.get("drain_timeout") is not None and not self.launcher.drain_timeout_per_command:
            return {"ok": False, "error": "under systemd the engine drains for its own [engine] drain_timeout "
                                          "(bounded by TimeoutStopSec=); --drain-timeout cannot change it per command"}
        timeout = float(cmd.args.get("drain_timeout") or self.sup.drain_timeout)
        if cmd.name == "drain":  # a load balancer's drain: the engine answers 503 until resumed
            self._set_busy(EngineState.DRAINING)
            try:
                return {"ok": True, "drain": self.engine.drain(float(cmd.args.get("timeout") or timeout))}
            finally:
                self._set_busy(None)
        if cmd.name == "resume":
            return {"ok": True, "resume": self.engine.resume()}
        if cmd.name == "restart":
            with self.lock:  # one step from gave_up to restarting: status never sees the engine in between
                self.state = replace(self.state, gave_up=False)
                self.gave_up_reason = None
                self.failed_permanently = False
                self._set_busy(EngineState.RESTARTING)
            self.metrics.gave_up.set(0)
            try:
                self._restart("manual", counts_as_crash=False, drain=bool(cmd.args.get("drain", True)),
                              timeout=timeout)
            except RestartFailed as e:
                return {"ok": False, "error": str(e)}
            return {"ok": True}
        if cmd.name == "stop":
            self._set_busy(EngineState.STOPPING)
            if cmd.args.get("engine", True):
                retired = self.launcher.stop(drain=bool(cmd.args.get("drain", True)), timeout=timeout)
                self._count_lost(retired.reason, retired.lost)
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
            return self.tracker.update(derive(
                gave_up=self.state.gave_up, permanent=self.failed_permanently, busy=self.busy, alive=alive,
                ready=self.state.ready_at is not None, health=self.last_reading.get("health", "unknown")))

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
                    state=state, health=health, health_detail=reading.get("health_detail"),
                    pid=self.launcher.pid() if alive else None,
                    uptime_s=round(time.time() - self.engine_started_wall, 1) if alive else None,
                    url=self.cfg.engine_url, model=reading.get("model"),
                    kv_cache_usage=metrics.get("cache_usage"), running=count("running"),
                    waiting=count("waiting"), oldest_waiting_s=metrics.get("oldest_waiting_s"),
                    steps_total=count("steps_total"),
                    metrics_error=reading.get("metrics_error"), process=reading.get("process"),
                    last_exit=self.launcher.exit_summary(),
                ),
                gpu=GpuStatus(self.gpu.available, self.gpu.reason, list(self.last_gpu)),
                last_decision=self.last_decision,
                restarts=RestartsStatus(total=len(self.restart_log), recent=self.restart_log[-10:],
                                        counted_for_crash_loop=len(self.state.restarts)),
                crash_loop=CrashLoopStatus(gave_up=self.state.gave_up, reason=self.gave_up_reason,
                                           permanent=self.failed_permanently, max_restarts=self.sup.max_restarts,
                                           restart_window_s=self.sup.restart_window),
                supervisor=SupervisorStatus(
                    pid=os.getpid(), launcher=self.launcher.name, dry_run=self.sup.dry_run,
                    uptime_s=round(time.time() - self.started_wall, 1),
                    metrics_url=f"http://{self.sup.metrics_host}:{self.metrics_port}/metrics",
                    config=self.cfg.source, instance=self.sup.instance,
                    runtime_dir=str(self.sup.runtime_path()), poll_interval_s=self.sup.poll_interval,
                    handover="overlap" if self._overlap() else "sequential"),
                engine_log=str(log_path) if log_path else None,
            )

def write_last_failure(runtime: Path, detail: str) -> None:
    write_private(runtime / LAST_FAILURE_NAME, json.dumps({"time": time.time(), "reason": detail}))


def read_last_failure(runtime: Path) -> dict[str, Any] | None:
    try:
        return json.loads((runtime / LAST_FAILURE_NAME).read_text())
    except (OSError, ValueError):
        return None


def _model_name(cfg: PagekeeperConfig) -> str:
    """The served model name the engine will report, as its metrics' model_name label."""
    from engine.config import EngineConfig

    known = {k: v for k, v in cfg.engine.items() if k in ("model", "served_model_name")}
    return EngineConfig(**known).model_name()


# -- control socket ---------------------------------------------------------------------------------


class _ControlHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        supervisor: Supervisor = self.server.supervisor  # type: ignore[attr-defined]
        try:
            request = json.loads(self.rfile.readline() or b"{}")
            reply = supervisor.submit(str(request.get("cmd", "")), dict(request.get("args") or {}),
                                      float(request.get("timeout", 900)))
        except (ValueError, TypeError) as e:
            reply = {"ok": False, "error": f"bad request: {e}"}
        self.wfile.write(json.dumps(reply, default=str).encode() + b"\n")


class _ControlServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def serve_control(supervisor: Supervisor, path: Path) -> _ControlServer:
    if path.exists():
        path.unlink()
    old = os.umask(0o177)  # the socket is created 0600: only its owner may command the supervisor
    try:
        server = _ControlServer(str(path), _ControlHandler)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    server.supervisor = supervisor  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, name="control", daemon=True).start()
    return server


def handover_overlaps(cfg: PagekeeperConfig, gpu: GpuProbe) -> bool:
    """Start the new engine before the old one leaves?  Where two engines fit: on CPU.

    `[supervisor] handover`: "overlap", "sequential", or "auto" (overlap unless the engine will run on a
    GPU: `[engine] device` names cuda, or is auto and NVML sees a GPU).
    """
    mode = cfg.supervisor.handover
    if mode != "auto":
        return mode == "overlap"
    device = str(cfg.engine.get("device", "auto"))
    if device.startswith("cuda"):
        return False
    if device == "cpu":
        return True
    return not (gpu.available and gpu.read())


def build_launcher(cfg: PagekeeperConfig, runtime: Path, gpu: GpuProbe) -> Launcher:
    choice = cfg.supervisor.launcher
    if choice == "auto":
        choice = "systemd" if systemd_available(cfg.supervisor.engine_unit()) else "process"
    if choice == "systemd":
        if cfg.supervisor.handover == "overlap":
            raise ConfigError("[supervisor] handover = \"overlap\" needs the process launcher: systemd runs one "
                              "engine unit at a time (its socket unit queues connections meanwhile); use "
                              "handover = \"auto\" or launcher = \"process\"")
        return SystemdLauncher(cfg.supervisor.engine_unit())
    return ProcessLauncher(cfg.engine_args(), cfg.host, cfg.port, runtime, runtime / ENGINE_LOG_NAME,
                           overlap=handover_overlaps(cfg, gpu), env=cfg.engine_env())


def instance_record(cfg: PagekeeperConfig, runtime: Path, metrics_port: int, pid: int | None = None) -> InstanceRecord:
    """What this instance claims (ports), as other instances' starts read it from `instance.json`."""
    return InstanceRecord(instance=cfg.supervisor.instance, config=cfg.source, supervisor_pid=pid or os.getpid(),
                          runtime_dir=str(runtime), host=cfg.host, port=cfg.port,
                          metrics_host=cfg.supervisor.metrics_host, metrics_port=metrics_port)


def _admin_key(cfg: PagekeeperConfig) -> str | None:
    """The admin key the engine was given, read the way the engine reads it (file, config, environment)."""
    if cfg.engine.get("admin_key_file"):
        return read_secret(cfg.engine["admin_key_file"], "[engine] admin_key_file")
    return cfg.engine.get("admin_key") or os.environ.get(SECRET_ENV["admin_key"]) or None


def hold_lock(runtime: Path) -> Any:
    """One supervisor per runtime dir: an exclusive flock held for the process's lifetime (or None)."""
    fd = os.open(runtime / LOCK_NAME, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opsctl.supervisor")
    parser.add_argument("--config", default=None)
    parser.add_argument("--runtime-dir", default=None)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--launcher", choices=("auto", "process", "systemd"), default=None)
    parser.add_argument("--instance", default=None)
    args = parser.parse_args(argv)
    configure_logging()
    try:
        cfg = load_config(args.config, {"supervisor": {"runtime_dir": args.runtime_dir,
                                                       "dry_run": True if args.dry_run else None,
                                                       "launcher": args.launcher, "instance": args.instance}})
        runtime = prepare_runtime_dir(cfg.supervisor.runtime_path())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lock = hold_lock(runtime)
    if lock is None:
        print(f"error: another supervisor already runs for {runtime}; `opsctl status` shows it", file=sys.stderr)
        return EXIT_ALREADY_RUNNING
    (runtime / LAST_FAILURE_NAME).unlink(missing_ok=True)
    try:
        claim = instance_record(cfg, runtime, cfg.supervisor.metrics_port)
        clash = port_clash(claim, running_instances(runtime))
        if clash:
            raise ConfigError(clash)
        open_private(runtime / ENGINE_LOG_NAME).close()  # a symlinked log is refused now, not at the first start
        gpu = gpu_probe()
        launcher = build_launcher(cfg, runtime, gpu)
        probe = EngineProbe(cfg.engine_url, cfg.supervisor.probe_timeout, admin_key=_admin_key(cfg))
        supervisor = Supervisor(cfg, launcher, probe, gpu)
        supervisor.serve_metrics()
        write_record(runtime, instance_record(cfg, runtime, supervisor.metrics_port or 0))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        write_last_failure(runtime, str(e))
        return 2
    control = serve_control(supervisor, runtime / SOCKET_NAME)
    write_private(runtime / PID_NAME, str(os.getpid()))

    def on_signal(signum: int, _frame: Any) -> None:
        # queue.put from a signal handler could deadlock on the queue's lock: hand it to a thread.
        # Under systemd the engine is a unit of its own: restarting the supervisor must not take it
        # down (`opsctl stop` still stops both).  A child engine goes down with its supervisor.
        keep = launcher.engine_outlives_supervisor
        log.info("supervisor_signal", signal=signal.Signals(signum).name, engine="left running" if keep else "stopped")
        stop = _Command("stop", {"drain": True, "engine": not keep})
        threading.Thread(target=supervisor.commands.put, args=(stop,)).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 1
    try:
        code = supervisor.run()
    finally:
        control.shutdown()
        for name in (SOCKET_NAME, PID_NAME, INSTANCE_FILE_NAME):
            (runtime / name).unlink(missing_ok=True)
        # A stop command stopped the engine already (unless it runs as a systemd unit of its own); a crash of
        # this daemon leaves it serving for the next supervisor to adopt.
        launcher.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
