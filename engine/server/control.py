"""The engine's private control channel: a unix socket only its supervisor talks to.

Over TCP the supervisor cannot choose which engine answers: while two engines share the held
listening socket (a restart on CPU starts the new engine before the old one leaves), a request to
`/drain` may land on either.  This socket belongs to one process, so "are you ready?", "hand over
and exit", "stop now" and "give me the listening socket" (for a supervisor that adopts a running
engine after its predecessor died) reach exactly that engine.  It runs in its own thread, so it
answers while the model loads and while the HTTP loop is busy.

`opsctl drain` and `opsctl resume` come this way too ("drain", "resume": `admin_handlers`): the same
load-balancer drain as `POST /drain`, which stays for load balancers, but asked with the supervisor's own
credential (the socket's owner), so that an engine with an API key needs no admin key for them.

One JSON line per connection, one JSON line back; the socket is created 0600 and a peer with
another uid is refused (SO_PEERCRED).  Each connection is served on a thread of its own: a drain that
waits for in-flight requests does not hold up a state query.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable

import structlog

from engine.lifecycle import Lifecycle

log = structlog.get_logger("pagekeeper.server")

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class ControlSocket:
    def __init__(
        self, path: str | os.PathLike[str], listen_sock: socket.socket, lifecycle: Lifecycle | None = None
    ) -> None:
        self.path = Path(path)
        self.listen_sock = listen_sock
        self.lifecycle = lifecycle or Lifecycle()  # `state` answers its phase (engine/lifecycle.py)
        # When a drain (or stop) must be over, on time.monotonic(): a supervisor that finds the HTTP side silent
        # reads it to tell an engine draining on its own (a SIGTERM from outside) from one that hangs.
        self.stop_deadline: float | None = None
        self.handlers: dict[str, Handler] = {}  # filled in once the server exists
        self._in_flight: Callable[[], int] = lambda: 0
        self._settled: Callable[[], bool] = lambda: False
        self.path.unlink(missing_ok=True)
        old = os.umask(0o177)
        try:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.bind(str(self.path))
        finally:
            os.umask(old)
        self._sock.listen(16)
        threading.Thread(target=self._serve, name="engine-control", daemon=True).start()

    @property
    def state(self) -> str:
        return self.lifecycle.phase.value

    def set_in_flight_reader(self, reader: Callable[[], int]) -> None:
        self._in_flight = reader

    def set_settled_reader(self, reader: Callable[[], bool]) -> None:
        """`settled` in the state reply: serving with its start-up work (graph captures, warm-ups) done, what the
        supervisor waits for before it starts a spare beside it (opsctl/launcher.py)."""
        self._settled = reader

    def close(self) -> None:
        self._sock.close()
        self.path.unlink(missing_ok=True)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve_one, args=(conn,), name="engine-control-request", daemon=True).start()

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(5)
                self._handle(conn)
            except Exception as e:  # one bad client never stops the channel
                log.warning("control_request_failed", error=str(e))

    @staticmethod
    def _peer(conn: socket.socket) -> tuple[int, int]:
        """(pid, uid) of the process at the other end, from the kernel, not from what it says."""
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        return pid, uid

    def _handle(self, conn: socket.socket) -> None:
        pid, uid = self._peer(conn)
        if uid not in (os.geteuid(), 0):
            log.warning("control_request_refused", peer_pid=pid, peer_uid=uid)
            conn.sendall(b'{"ok": false, "error": "not your engine"}\n')
            return
        line = conn.makefile("rb").readline()
        request = json.loads(line or b"{}")
        cmd = str(request.get("cmd", ""))
        if cmd != "state":  # every command that changes something is logged with who asked
            log.info("control_request", command=cmd, peer_pid=pid, peer_uid=uid, peer=_process_name(pid))
        if cmd == "state":
            reply = {"ok": True, "pid": os.getpid(), "state": self.state, "in_flight": self._in_flight()}
            reply["settled"] = self.state == "serving" and self._settled()
            if self.stop_deadline is not None:
                reply["stop_left_s"] = round(self.stop_deadline - time.monotonic(), 3)
        elif cmd == "listen_fd":
            socket.send_fds(conn, [b'{"ok": true}\n'], [self.listen_sock.fileno()])
            log.info("listening_socket_handed_over")
            return
        elif cmd in self.handlers:
            reply = self.handlers[cmd](request)
        elif cmd in ("drain_exit", "stop_now"):  # asked before the server exists: nothing is in flight
            log.info("exit_requested_while_loading", command=cmd, state=self.state)
            conn.sendall(json.dumps({"ok": True, "state": self.state}).encode() + b"\n")
            os._exit(0)
        else:
            reply = {"ok": False, "error": f"unknown command {cmd!r}"}
        conn.sendall(json.dumps(reply).encode() + b"\n")


def admin_handlers(async_engine: Any, loop: Callable[[], asyncio.AbstractEventLoop | None]) -> dict[str, Handler]:
    """ "drain" and "resume" for the control socket: `POST /drain` and `DELETE /drain`, run on the HTTP event loop
    (`loop()`, None until it runs) as those routes are, answered with the same document."""

    def on_loop(coro: Any, timeout: float) -> Any:
        running = loop()
        if running is None:
            coro.close()
            raise RuntimeError("the engine is not serving yet")
        return asyncio.run_coroutine_threadsafe(coro, running).result(timeout)

    def drain(req: dict[str, Any]) -> dict[str, Any]:
        timeout = float(req.get("timeout_s", 60.0))
        return {"ok": True, "drain": on_loop(async_engine.drain(timeout), timeout + 10).__dict__}

    async def resume() -> None:
        async_engine.resume()

    def resume_handler(req: dict[str, Any]) -> dict[str, Any]:
        on_loop(resume(), 10)
        return {"ok": True, "resume": {"status": "ok"}}

    def guarded(handler: Handler) -> Handler:
        def run(req: dict[str, Any]) -> dict[str, Any]:
            try:
                return handler(req)
            except (RuntimeError, TimeoutError) as e:
                return {"ok": False, "error": str(e) or type(e).__name__}

        return run

    return {"drain": guarded(drain), "resume": guarded(resume_handler)}


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        return " ".join(a.decode(errors="replace") for a in argv[:3] if a)[:120]
    except OSError:
        return "?"
