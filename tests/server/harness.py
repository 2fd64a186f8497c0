"""Start the real server (`python -m engine.server`) as a process on a free loopback port.

Used by the server tests and, later, by the supervisor and alert tests: no mocks, a real process
that is always killed by PID afterwards.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]


def tp_workers(pid: int) -> list[psutil.Process]:
    """The tensor-parallel worker processes (ranks > 0) an engine process started."""
    return [p for p in psutil.Process(pid).children() if "engine.distributed.worker" in " ".join(p.cmdline())]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()[-3000:]}")

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def start_server(
    tmp_path: Path,
    *args: str,
    port: int | None = None,
    env: dict[str, str] | None = None,
    wait: bool = True,
    pass_fds: tuple[int, ...] = (),
    preexec_fn=None,
    name: str = "server",
) -> ServerProcess:  # type: ignore[no-untyped-def]
    """`name`: the log's, for servers that share a port (a handover)."""
    port = port or free_port()
    log_path = tmp_path / f"{name}-{port}.log"
    cmd = [sys.executable, "-m", "engine.server", "--port", str(port), *args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=str(REPO),
            pass_fds=pass_fds,
            preexec_fn=preexec_fn,
        )
    server = ServerProcess(proc, port, log_path, cmd)
    if wait:
        try:
            server.wait_ready()
        except BaseException:
            server.kill()
            raise
    return server
