"""Start the real server (`python -m engine.server`) as a process on a free loopback port.

Used by the server tests and, later, by the supervisor and alert tests: no mocks, a real process
that is always killed by PID afterwards.
"""

from __future__ import annotations

import os
import random
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
    """The tensor-parallel worker processes (ranks > 0) under an engine process (its core's, by default)."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "engine.distributed.worker" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:  # gone, or a zombie not yet reaped: no longer a rank
            pass
    return found


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (source ports of outgoing connections)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port nothing listens on, below the kernel's ephemeral range.

    A server binds its port seconds after the port is chosen (its start-up).  A port from the ephemeral range, which
    bind(0) hands out, can meanwhile become the source port of any outgoing connection the suite makes: a full run
    once lost a test to "Address already in use" that way.  The kernel never hands out ports below the range as
    source ports, so only another test choosing the same one of ~12,000 can collide (start_server retries then).
    """
    low = _ephemeral_low()
    pick = random.SystemRandom()
    for _ in range(100):
        port = pick.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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
    """`name`: the log's, for servers that share a port (a handover).  A port this function chose that another
    process took before the server bound it is replaced, up to twice (the server exits 2 naming the clash)."""
    if port is not None:
        return _start_server(tmp_path, port, args, env, wait, pass_fds, preexec_fn, name)
    for _ in range(2):
        try:
            return _start_server(tmp_path, free_port(), args, env, wait, pass_fds, preexec_fn, name)
        except PortTaken:
            pass
    return _start_server(tmp_path, free_port(), args, env, wait, pass_fds, preexec_fn, name)


class PortTaken(RuntimeError):
    """The server exited 2 because its port was in use when it came to bind it."""


def _start_server(
    tmp_path: Path,
    port: int,
    args: tuple[str, ...],
    env: dict[str, str] | None,
    wait: bool,
    pass_fds: tuple[int, ...],
    preexec_fn,
    name: str,
) -> ServerProcess:  # type: ignore[no-untyped-def]
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
        except BaseException as e:
            server.kill()
            if isinstance(e, RuntimeError) and proc.returncode == 2 and "Address already in use" in server.log():
                raise PortTaken(str(e)) from e
            raise
    return server
