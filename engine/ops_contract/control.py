"""The supervisor's end of an engine's private control socket (engine/server/control.py serves it).

One JSON line per connection, one JSON line back, on a unix socket created 0600 that refuses a peer of another uid.
The commands an engine answers: `state` (its lifecycle phase, in flight, settled), `drain_exit` (hand over and
exit), `stop_now`, `listen_fd` (its listening socket, passed as a file descriptor), `drain` and `resume` (the
load balancer's drain).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any


def request(path: str | os.PathLike[str], cmd: str, timeout: float = 5.0, **args: Any) -> dict[str, Any]:
    """Send one command to an engine's control socket (OSError/ValueError when it does not answer)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        data = s.makefile("rb").readline()
    reply: dict[str, Any] = json.loads(data)  # the engine answers with one JSON object
    return reply


def receive_listening_socket(path: str | os.PathLike[str], timeout: float = 5.0) -> socket.socket:
    """Ask a running engine for its listening socket (a supervisor adopting it needs its own copy)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(b'{"cmd": "listen_fd"}\n')
        msg, fds, _flags, _addr = socket.recv_fds(s, 1024, 1)
    if not fds or not json.loads(msg or b"{}").get("ok"):
        raise OSError(f"the engine at {path} did not hand over its listening socket")
    sock = socket.socket(fileno=fds[0])
    sock.set_inheritable(True)
    return sock
