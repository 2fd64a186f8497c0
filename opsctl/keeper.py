"""The weights keeper the supervisor runs beside its engines (engine/keeper/ says what it is for).

The supervisor starts it with the engine's own flags, before the first engine, so that the two load in parallel;
every engine it starts then takes its weights from it (`--weights-keeper`).  The keeper lives as long as the
deployment: an engine's restart or crash leaves it alone, `opsctl stop` ends it, and a supervisor that dies leaves
it running for the next one to adopt (`keeper.json` names it, as `engine.json` names the engine).

A keeper that died is started again only when no engine holds the GPU (before an engine starts after the old one
exited): a keeper loading a second copy of the weights beside a serving engine could take the memory that engine
needs.  Meanwhile engines load their weights themselves: a dead keeper costs cold starts, never an outage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import structlog

from engine.keeper.protocol import request
from opsctl.runtime import open_private, write_private

log = structlog.get_logger("pagekeeper.supervisor")

KEEPER_SOCKET_NAME = "keeper.sock"
KEEPER_STATE_NAME = "keeper.json"
_STOP_S = 10.0


class KeeperProcess:
    def __init__(
        self, engine_args: list[str], runtime: Path, log_file: Path, env: dict[str, str] | None = None
    ) -> None:
        self.engine_args = engine_args
        self.runtime = runtime
        self.log_file = log_file
        self.env = env
        self.socket = runtime / KEEPER_SOCKET_NAME
        self._record = runtime / KEEPER_STATE_NAME
        self.pid: int | None = None
        self._create_time: float | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._adopt()

    # -- state ------------------------------------------------------------------------------------

    def alive(self) -> bool:
        if self.pid is None:
            return False
        if self._popen is not None:
            return self._popen.poll() is None
        try:
            p = psutil.Process(self.pid)
            return p.create_time() == self._create_time and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def state(self) -> dict[str, object] | None:
        """The keeper's own answer (state: loading, ready, failed), or None when it does not answer."""
        if not self.alive():
            return None
        try:
            reply, _, fds = request(self.socket, "state", 2.0)
        except (OSError, ValueError):
            return None
        for fd in fds:
            os.close(fd)
        return reply

    def describe(self) -> dict[str, object]:
        """For `opsctl status`."""
        reply = self.state()
        return {
            "pid": self.pid if self.alive() else None,
            "state": (reply or {}).get("state", "gone" if self.pid else "not started"),
            "load_seconds": (reply or {}).get("load_seconds"),
            "starts": self.starts,
        }

    # -- starting and stopping --------------------------------------------------------------------

    def ensure(self) -> bool:
        """Start the keeper unless one is alive; True when one is (it may still be loading)."""
        if self.alive():
            return True
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "engine.keeper", "--socket", str(self.socket), *self.engine_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        with open_private(self.log_file) as logf:
            logf.write(f"\n--- keeper start {time.strftime('%Y-%m-%dT%H:%M:%S')} ---\n".encode())
            logf.flush()
            self._popen = subprocess.Popen(
                cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # outlives a dying supervisor, like the engine
            )
        self.pid = self._popen.pid
        self._create_time = _create_time(self.pid)
        self.starts += 1
        write_private(self._record, json.dumps({"pid": self.pid, "create_time": self._create_time}))
        log.info("keeper_started", pid=self.pid, socket=str(self.socket), starts=self.starts)
        return True

    def stop(self) -> None:
        """Ask it to leave, then make sure it did (its memory goes back to the GPU)."""
        if self.alive():
            try:
                request(self.socket, "exit", 2.0)
            except (OSError, ValueError):
                self._signal(signal.SIGTERM)
            deadline = time.monotonic() + _STOP_S
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.alive():
                log.warning("keeper_kill", pid=self.pid)
                self._signal(signal.SIGKILL)
            if self._popen is not None:
                self._popen.wait(timeout=_STOP_S)
            log.info("keeper_stopped", pid=self.pid)
        self.pid = None
        self._popen = None
        self._record.unlink(missing_ok=True)
        self.socket.unlink(missing_ok=True)

    def _signal(self, sig: signal.Signals) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def _adopt(self) -> None:
        """Take over the keeper a dead supervisor left running (`keeper.json`), if it is alive."""
        try:
            recorded = json.loads(self._record.read_text())
            self.pid, self._create_time = int(recorded["pid"]), recorded.get("create_time")
        except (OSError, ValueError, KeyError, TypeError):
            self.pid = None
            return
        if not self.alive():
            self.pid = None
            self._record.unlink(missing_ok=True)
            return
        log.warning("keeper_adopted", pid=self.pid, detail="the previous supervisor's keeper still holds the weights")


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None
