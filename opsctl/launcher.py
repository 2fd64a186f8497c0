"""How the supervisor starts, stops and restarts the engine: as its child, or through systemd.

`ProcessLauncher` binds the engine's listening socket once, in the supervisor, and hands it to
every engine process it starts (`--listen-fd`): while an engine restarts, new connections wait in
the kernel's accept queue and are served by the next engine instead of being refused.  The engine
runs in its own process group with its output in a log file that `opsctl logs` reads.

`SystemdLauncher` drives the engine unit with systemctl (socket activation gives the same
property there; see systemd/).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

import structlog

from engine.server.sockets import bind

log = structlog.get_logger("pagekeeper.supervisor")

_LOG_TAIL_BYTES = 4096


class Launcher(Protocol):
    name: str

    def start(self) -> None: ...
    def stop(self, grace: float) -> None: ...
    def pid(self) -> int | None: ...
    def alive(self) -> bool: ...
    def exit_summary(self) -> str | None: ...
    def log_path(self) -> Path | None: ...


def tail(path: Path | None, max_bytes: int = _LOG_TAIL_BYTES) -> str:
    if path is None or not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - max_bytes))
        return f.read().decode(errors="replace")


def error_lines(log_text: str, limit: int = 5) -> str:
    """The lines a person needs from an engine's log: its `error:` line (exit 2) or the traceback end."""
    lines = [ln for ln in log_text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    return "\n".join(errors[-limit:] if errors else lines[-limit:])


class ProcessLauncher:
    name = "process"

    def __init__(self, engine_args: list[str], host: str, port: int, log_file: Path,
                 env: dict[str, str] | None = None) -> None:
        self.engine_args = engine_args
        self.log_file = log_file
        self.env = env
        self._proc: subprocess.Popen | None = None
        self._last_exit: str | None = None
        self.sock = bind(host, port, hint="change [engine] port")

    def start(self) -> None:
        if self.alive():
            return
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        fd = self.sock.fileno()
        cmd = [sys.executable, "-m", "engine.server", *self.engine_args, "--listen-fd", str(fd)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        with open(self.log_file, "ab") as logf:
            logf.write(f"\n--- engine start {time.strftime('%Y-%m-%dT%H:%M:%S')} ---\n".encode())
            logf.flush()
            self._proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                          pass_fds=(fd,), start_new_session=True)
        log.info("engine_started", launcher=self.name, pid=self._proc.pid)

    def stop(self, grace: float) -> None:
        """SIGTERM (the engine drains), SIGCONT in case it is stopped, SIGKILL after `grace` seconds."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            self._note_exit()
            return
        for sig in (signal.SIGTERM, signal.SIGCONT):
            _signal_group(proc.pid, sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            log.warning("engine_kill", pid=proc.pid, after_s=grace)
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self._note_exit()

    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        if self._proc is None:
            return False
        if self._proc.poll() is None:
            return True
        self._note_exit()
        return False

    def _note_exit(self) -> None:
        if self._proc is not None and self._proc.returncode is not None and self._last_exit is None:
            code = self._proc.returncode
            what = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            detail = error_lines(tail(self.log_file))
            self._last_exit = f"{what}: {detail}" if detail else what
            log.info("engine_exited", pid=self._proc.pid, how=what)

    def exit_summary(self) -> str | None:
        return self._last_exit

    def forget_exit(self) -> None:
        self._last_exit = None

    def log_path(self) -> Path | None:
        return self.log_file

    def close(self) -> None:
        self.sock.close()


class SystemdLauncher:
    name = "systemd"

    def __init__(self, unit: str) -> None:
        self.unit = unit
        self._last_exit: str | None = None

    def _ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["systemctl", *args], capture_output=True, text=True, check=check, timeout=600)

    def start(self) -> None:
        self._ctl("start", self.unit)

    @property
    def socket_unit(self) -> str:
        return self.unit.rsplit(".", 1)[0] + ".socket"

    def stop(self, grace: float) -> None:
        """Stop the service and its listening socket: with the socket left active, the next connection
        would start the engine again (socket activation).  The engine drains on systemd's SIGTERM."""
        self._ctl("stop", self.socket_unit, self.unit, check=False)

    def restart(self) -> None:
        """Restart the service (never the socket, so queued connections survive)."""
        self._ctl("restart", self.unit)

    def pid(self) -> int | None:
        out = self._ctl("show", "-p", "MainPID", "--value", self.unit, check=False).stdout.strip()
        return int(out) if out.isdigit() and int(out) > 0 else None

    def alive(self) -> bool:
        state = self._ctl("is-active", self.unit, check=False).stdout.strip()
        if state in ("active", "activating", "reloading", "deactivating"):
            return True
        self._last_exit = f"unit {state}: " + self._ctl(
            "show", "-p", "Result", "-p", "ExecMainStatus", "--value", self.unit, check=False).stdout.replace("\n", " ")
        return False

    def exit_summary(self) -> str | None:
        return self._last_exit

    def forget_exit(self) -> None:
        self._last_exit = None

    def log_path(self) -> Path | None:
        return None  # journalctl -u <unit>


def systemd_available(unit: str) -> bool:
    """PID 1 is systemd and the engine unit is installed."""
    if not Path("/run/systemd/system").is_dir() or shutil.which("systemctl") is None:
        return False
    r = subprocess.run(["systemctl", "cat", unit], capture_output=True, text=True)
    return r.returncode == 0


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
