"""The test harness's ports: chosen outside the kernel's ephemeral range, and a chosen port that another process took
before the server bound it is replaced instead of failing the test (a full suite run once lost a test that way)."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from tests.server import harness

pytestmark = pytest.mark.slow


def test_free_ports_lie_below_the_ephemeral_range() -> None:
    low = harness._ephemeral_low()
    ports = {harness.free_port() for _ in range(200)}
    assert all(1024 <= p < low for p in ports), sorted(ports)[:5]
    assert len(ports) > 150  # spread out, so two workers seldom pick the same one


def test_a_port_taken_before_the_server_binds_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        # given explicitly, a taken port is the caller's to deal with: the server's exit 2 is reported as such
        with pytest.raises(harness.PortTaken, match="Address already in use"):
            harness.start_server(tmp_path, port=taken)
        # chosen by the harness: the first choice is taken (as if another process won the race), the next serves
        choices = iter([taken])
        real = harness.free_port
        monkeypatch.setattr(harness, "free_port", lambda: next(choices, None) or real())
        server = harness.start_server(tmp_path)
        try:
            assert server.port != taken
            assert httpx.get(server.url + "/health").json() == {"status": "ok"}
            print(f"port {taken} was taken; the server came up on {server.port}")
        finally:
            server.kill()
