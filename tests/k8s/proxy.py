"""A local stand-in for a Kubernetes Service: a round-robin TCP proxy over the ready endpoints.

Like kube-proxy, it balances connections, not requests: each new client connection goes to the next ready
endpoint and stays there (a kept-alive connection keeps reaching the same pod), and an endpoint taken out of
rotation keeps its open connections.  Endpoints come and go as a kubelet would report them (readiness) and as
the endpoints controller drops a terminating pod, after a lag, as in a real cluster.  It counts connections per
endpoint so that a test can show where the traffic went.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RoundRobinProxy:
    host: str = "127.0.0.1"
    port: int = 0
    endpoints: list[int] = field(default_factory=list)  # ports of the ready pods, in rotation order
    connections: Counter = field(default_factory=Counter)  # per endpoint port: connections sent there
    open_now: Counter = field(default_factory=Counter)  # per endpoint port: connections open now
    no_endpoint: int = 0  # connections refused because no endpoint was ready
    _next: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _server: asyncio.base_events.Server | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> RoundRobinProxy:
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), name="proxy", daemon=True).start()
        if not ready.wait(10):
            raise RuntimeError("the proxy did not start")
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def add(self, port: int) -> None:
        with self._lock:
            if port not in self.endpoints:
                self.endpoints.append(port)

    def remove(self, port: int) -> None:
        with self._lock:
            if port in self.endpoints:
                self.endpoints.remove(port)

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and self._server is not None:
            loop.call_soon_threadsafe(self._server.close)
            loop.call_soon_threadsafe(loop.stop)

    # -- the event loop's side --------------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        self._server = loop.run_until_complete(asyncio.start_server(self._serve, self.host, self.port))
        self.port = self._server.sockets[0].getsockname()[1]
        ready.set()
        loop.run_forever()

    def _pick(self) -> int | None:
        with self._lock:
            if not self.endpoints:
                return None
            port = self.endpoints[self._next % len(self.endpoints)]
            self._next += 1
            return port

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        port = self._pick()
        if port is None:
            self.no_endpoint += 1
            client_w.close()
            return
        try:
            backend_r, backend_w = await asyncio.open_connection(self.host, port)
        except OSError:
            client_w.close()
            return
        self.connections[port] += 1
        self.open_now[port] += 1
        try:
            await asyncio.gather(_pipe(client_r, backend_w), _pipe(backend_r, client_w))
        finally:
            self.open_now[port] -= 1
            backend_w.close()
            client_w.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then pass the half-close on (a server's close reaches the client); a reset closes both."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
