"""Handing traffic over to the next engine without failing a request.

When the listening socket is held by someone else (opsctl's supervisor or systemd), a restart needs
no 503 at all: the old engine stops calling accept(), so new connections wait in the kernel's queue
for the next engine; requests that reach it on connections it already has are still served, but
answered with `Connection: close`, so every client's next request opens a new connection (to the
next engine); keep-alive connections that stay idle are closed once nothing can be on its way on
them.  `HttpTracker` is the ASGI side of that (it counts requests in flight and adds the header);
`HandoverDrain` is the loop that waits for the connections to empty.

`InflightFile` publishes the count of requests in flight in an 8-byte file that the supervisor reads
after an engine died without warning (kill -9, OOM killer): those requests are what the crash cost,
and the supervisor exports them as a metric.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import struct
import termios
import time
from typing import Any, Awaitable, Callable

import structlog

from engine.ops_contract.inflight import InflightFile

log = structlog.get_logger("pagekeeper.server")

# Paths that are probes, not work: a supervisor or load balancer polling them is not a request in flight.
_PROBE_PATHS = ("/health", "/metrics")
# A keep-alive connection that stayed idle this long after the handover began is closed.  Clients that
# send requests back to back reuse their connection within milliseconds (and are then answered with
# `Connection: close`), so only connections nobody is using are closed this way.
IDLE_CLOSE_S = 1.0
_POLL_S = 0.02


class HttpTracker:
    """ASGI middleware: counts requests in flight; once `closing`, answers with `Connection: close`; once
    `stopping` (stop without draining), answers every new request with a retryable 503 at once."""

    def __init__(self, app: Any, inflight: InflightFile | None = None) -> None:
        self.app = app
        self.inflight = inflight
        self.in_flight = 0
        self.aborted = 0
        self.closing = False
        self.stopping = False

    def _count(self, delta: int) -> None:
        self.in_flight += delta
        if self.inflight is not None:
            self.inflight.set(self.in_flight)

    def count_aborted(self, n: int) -> None:
        self.aborted += n
        if self.inflight is not None:
            self.inflight.set_aborted(self.aborted)

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http" or scope["path"] in _PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        if self.stopping:
            self.count_aborted(1)
            await _send_restarting(send)
            return

        counted = False

        async def send_closing(message: dict[str, Any]) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and self.closing:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": headers + [(b"connection", b"close")]}
            if (
                self.stopping
                and not counted
                and (  # a request the stop failed: a 503, or an error event
                    message.get("status") == 503 or b'"engine_restarting"' in message.get("body", b"")
                )
            ):
                counted = True
                self.count_aborted(1)
            await send(message)

        self._count(+1)
        try:
            await self.app(scope, receive, send_closing)
        finally:
            self._count(-1)


RESTARTING_MESSAGE = "the engine is restarting without draining; retry the request"


async def _send_restarting(send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    body = json.dumps(
        {
            "error": {
                "message": RESTARTING_MESSAGE,
                "type": "ServiceUnavailableError",
                "param": None,
                "code": "engine_restarting",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def pending_bytes(transport: Any) -> int:
    """Bytes the kernel holds for this connection that the server has not read yet (FIONREAD)."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.fileno() < 0:
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0])
    except OSError:
        return 0


def is_idle(conn: Any) -> bool:
    """No request is being read or answered on this connection (uvicorn's h11 and httptools protocols)."""
    cycle = getattr(conn, "cycle", None)
    return cycle is None or bool(getattr(cycle, "response_complete", False))


def is_probe_connection(conn: Any) -> bool:
    """Its last request was a probe (/health, /metrics): the supervisor's poll, a load balancer's check, a scrape.

    A prober polls more often than IDLE_CLOSE_S (the supervisor every 0.5 s on one kept-alive connection), so its
    connection is never idle long enough to be closed, and probes are not answered `Connection: close`: a drain that
    waited for it held its engine for the whole drain timeout (60 s in a chaos run) with nothing in flight.  A probe
    cut by the exit costs nothing; the prober asks again."""
    scope = getattr(getattr(conn, "cycle", None), "scope", None) or {}
    return scope.get("path") in _PROBE_PATHS


class HandoverDrain:
    """Close this engine's connections one by one as they fall idle; done when none is left.

    Connections whose response has not started when it starts close after it (`Connection: close`); streams
    already under way end and fall idle; requests that arrive on idle ones are served with `Connection: close`;
    a connection idle for IDLE_CLOSE_S is closed.
    """

    def __init__(self, connections: set[Any], tracker: HttpTracker) -> None:
        self.connections = connections
        self.tracker = tracker

    def begin(self) -> None:
        self.tracker.closing = True
        for conn in list(self.connections):
            cycle = getattr(conn, "cycle", None)
            if cycle is not None and not is_idle(conn) and not getattr(cycle, "response_started", True):
                # Its response will say `Connection: close` (the tracker adds it), so its client will not reuse it.
                cycle.keep_alive = False
            # A response already under way (a stream) has sent its headers without `Connection: close`: closed the
            # moment it ends, its client may send the next request into the closing socket and read a reset (CI
            # lost two requests so).  Left open, it falls idle and is closed as below, or its next request is
            # answered with `Connection: close`.

    async def wait(self, timeout: float, busy: Callable[[], bool]) -> bool:
        """True once no request (`busy()`) and no connection but probes' is left; False at the timeout."""
        start = time.monotonic()
        idle_since: dict[Any, tuple[float, Any]] = {}
        while True:
            now = time.monotonic()
            for conn in list(self.connections):
                if not is_idle(conn):
                    idle_since.pop(conn, None)
                    continue
                since, cycle = idle_since.setdefault(conn, (now, getattr(conn, "cycle", None)))
                if getattr(conn, "cycle", None) is not cycle:  # served a request meanwhile
                    idle_since[conn] = (now, conn.cycle)
                elif now - since >= IDLE_CLOSE_S and pending_bytes(getattr(conn, "transport", None)) == 0:
                    conn.shutdown()  # an idle keep-alive connection: closed cleanly, nothing lost
            clients = [c for c in self.connections if not is_probe_connection(c)]
            if not clients and not busy() and self.tracker.in_flight == 0:
                return True
            if now - start >= timeout:
                log.warning(
                    "handover_timeout",
                    connections=len(self.connections),
                    in_flight=self.tracker.in_flight,
                    timeout_s=timeout,
                )
                return False
            await asyncio.sleep(_POLL_S)
