"""The supervisor process: `python -m opsctl.supervisor`, which `opsctl start` (or systemd) runs.

It wires the daemon together (config, runtime dir, launcher, probes, exporter, control socket) around the
loop in opsctl/daemon.py, and owns what belongs to the process: the one-supervisor-per-runtime-dir lock,
signals, and the files it leaves for `opsctl` (pid, instance claim, last failure).

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
import os
import signal
import sys
from pathlib import Path
from typing import Any

import structlog

from engine.config import ConfigError
from engine.logs import configure_logging
from engine.ops_contract.secrets import key_from_config
from opsctl.bytecode import bytecode_plan
from opsctl.config import PagekeeperConfig, load_config
from opsctl.constants import (
    ENGINE_CONFIG_NAME,
    ENGINE_LOG_NAME,
    EXIT_ALREADY_RUNNING,
    INSTANCE_FILE_NAME,
    LAST_FAILURE_NAME,
    LOCK_NAME,
    PID_NAME,
    SOCKET_NAME,
)
from opsctl.control_server import close_control, serve_control
from opsctl.daemon import Supervisor
from opsctl.instances import instance_record, port_clash, running_instances, write_record
from opsctl.keeper import KeeperProcess
from opsctl.launcher import Launcher, ProcessLauncher, SystemdLauncher, systemd_available
from opsctl.logecho import LogEcho
from opsctl.probes import EngineProbe, GpuProbe, gpu_probe
from opsctl.runtime import open_private, prepare_runtime_dir, write_last_failure, write_private

log = structlog.get_logger("pagekeeper.supervisor")


def handover_overlaps(cfg: PagekeeperConfig, gpu: GpuProbe) -> bool:
    """Start the new engine before the old one leaves?  Where two engines fit: on CPU.

    `[supervisor] handover`: "overlap", "sequential", or "auto" (overlap unless the engine will run on a
    GPU: `[engine] device` names cuda, or is auto and NVML sees a GPU).
    """
    mode = cfg.supervisor.handover
    if mode != "auto":
        return mode == "overlap"
    return not engine_on_gpu(cfg, gpu)


def engine_on_gpu(cfg: PagekeeperConfig, gpu: GpuProbe) -> bool:
    """Will the engine run on a GPU?  `[engine] device` names cuda, or is auto and NVML sees one."""
    device = str(cfg.engine.get("device", "auto"))
    if device.startswith("cuda"):
        return True
    if device == "cpu":
        return False
    return bool(gpu.available and gpu.read())


def keeps_weights(cfg: PagekeeperConfig, gpu: GpuProbe) -> bool:
    """`[supervisor] keep_weights`: on, off, or auto (on for a GPU engine)."""
    mode = cfg.supervisor.keep_weights
    return mode == "on" or (mode == "auto" and engine_on_gpu(cfg, gpu))


def engine_bytecode_env(cfg: PagekeeperConfig) -> dict[str, str]:
    """`[supervisor] bytecode_cache` (opsctl/bytecode.py): a bytecode folder where the installation keeps none."""
    plan = bytecode_plan(dict(os.environ), cfg.supervisor.bytecode_cache)
    if plan.env:
        log.info("bytecode_cache", folder=plan.env["PYTHONPYCACHEPREFIX"], reason=plan.reason)
    return plan.env


def build_launcher(cfg: PagekeeperConfig, runtime: Path, gpu: GpuProbe) -> Launcher:
    """systemd when asked (or, with "auto", when the engine unit is installed), else a child process."""
    choice = cfg.supervisor.launcher
    if choice == "auto":
        choice = "systemd" if systemd_available(cfg.supervisor.engine_unit()) else "process"
    if choice == "systemd":
        if cfg.supervisor.handover == "overlap":
            raise ConfigError(
                '[supervisor] handover = "overlap" needs the process launcher: systemd runs one '
                "engine unit at a time (its socket unit queues connections meanwhile); use "
                'handover = "auto" or launcher = "process"'
            )
        return SystemdLauncher(cfg.supervisor.engine_unit())
    env = engine_bytecode_env(cfg)
    section_file = runtime / ENGINE_CONFIG_NAME
    command_line = cfg.engine_command_line(section_file)
    keep = keeps_weights(cfg, gpu)
    keeper = KeeperProcess(command_line, runtime, runtime / ENGINE_LOG_NAME, env) if keep else None
    overlap = handover_overlaps(cfg, gpu)
    spare = cfg.supervisor.spare_engine == "on" or (cfg.supervisor.spare_engine == "auto" and keep and not overlap)
    return ProcessLauncher(
        command_line,
        cfg.host,
        cfg.port,
        runtime,
        runtime / ENGINE_LOG_NAME,
        overlap=overlap,
        env=env,
        keeper=keeper,
        spare=spare,
        explain=lambda line: engine_error_in_config_terms(line, cfg, section_file),
    )


def engine_error_in_config_terms(line: str, cfg: PagekeeperConfig, section_file: Path) -> str:
    """The engine names a value the config file gave by its key, after the file it read: the section the supervisor
    wrote for it, which is the config file the person edits (`cfg.source`) as far as they are concerned."""
    return line.replace(str(section_file.resolve()), cfg.source)


def _admin_key(cfg: PagekeeperConfig) -> str | None:
    """The admin key the engine it starts uses: one rule for both (engine/ops_contract/secrets.py)."""
    return key_from_config("admin_key", cfg.engine)


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
    # `opsctl start --model/--port/--host`: the [engine] keys, over the file's
    parser.add_argument("--model", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--host", default=None)
    args = parser.parse_args(argv)
    configure_logging()
    try:
        cfg = load_config(
            args.config,
            {
                "supervisor": {
                    "runtime_dir": args.runtime_dir,
                    "dry_run": True if args.dry_run else None,
                    "launcher": args.launcher,
                    "instance": args.instance,
                },
                "engine": {"model": args.model, "port": args.port, "host": args.host},
            },
        )
        runtime = prepare_runtime_dir(cfg.supervisor.runtime_path())
        if cfg.supervisor.log_to_stdout:
            configure_logging(force=True, stream=sys.stdout)
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
    echo = LogEcho(runtime / ENGINE_LOG_NAME).start() if cfg.supervisor.log_to_stdout else None
    control = serve_control(supervisor.submit, runtime / SOCKET_NAME)
    write_private(runtime / PID_NAME, str(os.getpid()))

    def on_signal(signum: int, _frame: Any) -> None:
        # queue.put from a signal handler could deadlock on the queue's lock: hand it to a thread.
        # Under systemd the engine is a unit of its own: restarting the supervisor must not take it
        # down (`opsctl stop` still stops both).  A child engine goes down with its supervisor.
        keep = launcher.engine_outlives_supervisor
        log.info("supervisor_signal", signal=signal.Signals(signum).name, engine="left running" if keep else "stopped")
        supervisor.request_stop(engine=not keep)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 1
    try:
        code = supervisor.run()
    finally:
        close_control(control)
        for name in (SOCKET_NAME, PID_NAME, INSTANCE_FILE_NAME):
            (runtime / name).unlink(missing_ok=True)
        # A stop command stopped the engine already (unless it runs as a systemd unit of its own); a crash of
        # this daemon leaves it serving for the next supervisor to adopt.
        launcher.close()
        if echo is not None:
            echo.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
