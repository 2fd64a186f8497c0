"""The supervisor's control socket: one JSON request and one JSON reply per connection.

`opsctl` (opsctl/control.py is the client) commands the daemon through a unix socket created 0600 in
the runtime dir, so that only its owner may.  This module only carries requests: each connection's
thread hands its command to `submit` (the daemon's, which queues it for the loop thread, so commands
never race the poll loop's own actions) and writes back the reply.
"""

from __future__ import annotations

import json
import os
import socketserver
import threading
from pathlib import Path
from typing import Any, Callable

from opsctl.constants import COMMAND_TIMEOUT_S

CLOSE_GRACE_S = 5.0  # longest wait for replies in flight when the supervisor exits

# submit(command, args, timeout_s) -> reply
Submit = Callable[[str, dict[str, Any], float], dict[str, Any]]


class _ControlHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        assert isinstance(self.server, _ControlServer)
        submit = self.server.submit
        try:
            request = json.loads(self.rfile.readline() or b"{}")
            reply = submit(
                str(request.get("cmd", "")),
                dict(request.get("args") or {}),
                float(request.get("timeout", COMMAND_TIMEOUT_S)),
            )
        except (ValueError, TypeError) as e:
            reply = {"ok": False, "error": f"bad request: {e}"}
        self.wfile.write(json.dumps(reply, default=str).encode() + b"\n")


class _ControlServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    submit: Submit  # set by serve_control before the first connection

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answering = 0  # connections whose reply is not yet written
        self.answered = threading.Condition()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self.answered:
            self.answering += 1
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.answered:
                self.answering -= 1
                self.answered.notify_all()


def close_control(server: socketserver.BaseServer, grace_s: float = CLOSE_GRACE_S) -> int:
    """Stop accepting, then give replies being written up to `grace_s` to reach their clients (the stop command's
    own reply is written by a handler thread after the loop has ended: a process that exits at once cut it off, and
    `opsctl stop` said the supervisor was not running).  Returns how many connections were still unanswered."""
    server.shutdown()
    left = 0
    if isinstance(server, _ControlServer):
        with server.answered:
            server.answered.wait_for(lambda: server.answering == 0, timeout=grace_s)
            left = server.answering
    server.server_close()
    return left


def serve_control(submit: Submit, path: Path) -> socketserver.BaseServer:
    """Listen on `path` (replacing a stale socket) from a thread; each request goes to `submit`."""
    if path.exists():
        path.unlink()
    old = os.umask(0o177)  # the socket is created 0600: only its owner may command the supervisor
    try:
        server = _ControlServer(str(path), _ControlHandler)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    server.submit = submit
    threading.Thread(target=server.serve_forever, name="control", daemon=True).start()
    return server
