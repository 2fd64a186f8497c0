"""What one client can cost the server: body size, connections, and time to send a request head.

A valid but huge request must not stall everyone (a body over the limit is refused with 413 before it
is read), and clients that open connections and send nothing (slowloris) must not exhaust the open-file
limit: a connection gets `header_timeout` seconds to send a complete request head, and once
`max_connections` are open, the longest-idle connection (one with no request in progress) is closed to
make room, so that clients with real requests keep being served.
"""

from __future__ import annotations

import json
import resource
from typing import Any, Awaitable, Callable

from engine.server.handover import is_idle, pending_bytes


def connection_limit() -> int:
    """The default --max-connections: a quarter of the open-file limit (at least 100) is kept for everything
    else the process opens (model files, logs, pipes) and for asyncio, which accepts a burst of connections
    before any of them is counted."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 10_000
    return max(8, soft - max(100, soft // 4))


class AcceptErrorsCondensed:
    """A loop exception handler: asyncio's "socket.accept() out of system resource" (a traceback per
    failed accept, thousands a second when files run out) becomes one warning line every 10 s with a count;
    everything else goes to the default handler."""

    INTERVAL_S = 10.0

    def __init__(self) -> None:
        self.count = 0
        self.last = float("-inf")

    def __call__(self, loop: Any, context: dict) -> None:
        if not str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            loop.default_exception_handler(context)
            return
        self.count += 1
        now = loop.time()
        if now - self.last >= self.INTERVAL_S:
            import structlog

            structlog.get_logger("pagekeeper.server").warning(
                "accept_out_of_files",
                failed_accepts=self.count,
                error=str(context.get("exception")),
                hint="raise the open-file limit (LimitNOFILE=) or lower --max-connections",
            )
            self.last = now
            self.count = 0


class BodyLimit:
    """ASGI middleware: a body larger than `limit` bytes gets 413, read no further than the limit."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(
        self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        seen = 0
        too_large = False

        async def counting_receive() -> dict:
            nonlocal seen, too_large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # a chunked body with no length: stop at the limit
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            if not too_large:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)
        if too_large:
            await self._refuse(send)

    async def _refuse(self, send: Callable[[dict], Awaitable[None]]) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": f"the request body is larger than {self.limit} bytes (--max-request-body-bytes)",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 413,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def guarded_protocol(max_connections: int, header_timeout: float) -> type:
    """uvicorn's HTTP protocol with the limits above, and a keep-alive timeout that never resets a request.

    The keep-alive timeout leaves a connection on which a request has already arrived: closing a socket
    with unread data makes the kernel send a reset, so the client sees its request fail although it was
    sent in time.  That happens whenever the event loop runs late, e.g. an engine resumed after SIGSTOP:
    the interrupted select() returns no events once its deadline has passed (PEP 475), so overdue timers
    run before the requests that arrived meanwhile are read.
    """
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.last_active = self.loop.time()
            self._arm_header_timer()
            if len(self.connections) > max_connections:
                self._make_room()

        def data_received(self, data: bytes) -> None:
            self.last_active = self.loop.time()
            super().data_received(data)

        def on_response_complete(self) -> None:
            self.last_active = self.loop.time()
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request head gets the same time

        def _arm_header_timer(self) -> None:
            cycle = self.cycle
            self.loop.call_later(header_timeout, self._header_deadline, cycle)

        def _header_deadline(self, cycle_then: Any) -> None:
            if self.transport.is_closing() or self.cycle is not cycle_then or not is_idle(self):
                return  # a request head arrived (and maybe its answer) since the timer was armed
            if pending_bytes(self.transport) > 0:
                self._arm_header_timer()  # bytes are waiting to be read: the loop is merely late
                return
            self.transport.close()

        def _make_room(self) -> None:
            idle = [
                c
                for c in self.connections
                if c is not self and is_idle(c) and not c.transport.is_closing() and pending_bytes(c.transport) == 0
            ]
            if not idle:
                return  # every connection is working: this one waits its turn like the rest
            oldest = min(idle, key=lambda c: getattr(c, "last_active", 0.0))
            oldest.transport.close()

        def timeout_keep_alive_handler(self) -> None:
            if pending_bytes(self.transport) > 0:  # a request is waiting: the loop reads it next
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
                return
            super().timeout_keep_alive_handler()

    return GuardedProtocol
