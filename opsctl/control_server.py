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
