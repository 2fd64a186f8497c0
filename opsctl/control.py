"""The client side of the supervisor's control socket (one JSON request, one JSON reply)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from opsctl.constants import COMMAND_TIMEOUT_S, SOCKET_NAME, STATUS_TIMEOUT_S
from opsctl.status import Status


class SupervisorNotRunning(RuntimeError):
    pass


def socket_path(runtime_dir: Path) -> Path:
    return runtime_dir / SOCKET_NAME


def send(
    runtime_dir: Path, cmd: str, args: dict[str, Any] | None = None, timeout: float = COMMAND_TIMEOUT_S
) -> dict[str, Any]:
    path = socket_path(runtime_dir)
    if not path.exists():
        raise SupervisorNotRunning(f"no supervisor socket at {path}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout + 5)
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError) as e:
            raise SupervisorNotRunning(f"supervisor socket {path} does not answer ({e})") from e
        s.sendall(json.dumps({"cmd": cmd, "args": args or {}, "timeout": timeout}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    if not data:
        raise SupervisorNotRunning("the supervisor closed the connection without answering")
    reply: dict[str, Any] = json.loads(data)  # the supervisor answers with one JSON object
    return reply


def status(runtime_dir: Path) -> dict[str, Any]:
    """The status as the JSON `opsctl status --json` prints."""
    status_: dict[str, Any] = send(runtime_dir, "status", timeout=STATUS_TIMEOUT_S)["status"]
    return status_


def read_status(runtime_dir: Path) -> Status:
    """The status, typed; ValueError when the reply is not one."""
    return Status.from_json(status(runtime_dir))


def is_running(runtime_dir: Path) -> bool:
    try:
        status(runtime_dir)
        return True
    except (SupervisorNotRunning, OSError, ValueError):
        return False
