"""Handing traffic over to the next engine (engine/server/handover.py), on real server processes.

Two engines share one listening socket the test holds, as opsctl's supervisor does.  The old one is
told to hand over: it stops accepting, answers what reaches it on open connections with
`Connection: close`, and exits; kept-alive clients move to the new engine without an error.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import pytest

from engine.ops_contract import control
from engine.ops_contract.inflight import InflightFile
from tests.opsctl.load import Load, tally

pytestmark = pytest.mark.slow


def _held_socket() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    listener.set_inheritable(True)
    return listener


def _engine(launch, listener: socket.socket, tmp_path, name: str, *flags: str):  # type: ignore[no-untyped-def]
    """An engine on the held socket, waited for through its own control socket (over TCP, /health may be
    answered by the other engine)."""
    ctl = tmp_path / f"{name}.sock"
    inflight = tmp_path / f"{name}.inflight"
    server = launch(
        "--listen-fd",
        str(listener.fileno()),
        "--control-socket",
        str(ctl),
        "--inflight-file",
        str(inflight),
        *flags,
        port=listener.getsockname()[1],
        pass_fds=(listener.fileno(),),
        wait=False,
        name=name,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.log()[-3000:]
        try:
            if control.request(ctl, "state", timeout=1)["state"] == "serving":
                return server, ctl, inflight
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"engine {name} not serving:\n{server.log()[-3000:]}")


def _shared(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if '"cpu_threads_shared"' in line]


def test_handover_to_a_second_engine_loses_no_request(launch, tmp_path):
    """As opsctl's overlapping restart runs it: the new engine beside the old one on half the CPU threads, the
    old one on the other half while it drains, the new one on all of them once the old one has gone."""
    listener = _held_socket()
    try:
        old, old_ctl, old_inflight = _engine(launch, listener, tmp_path, "old")
        assert control.request(old_ctl, "state")["state"] == "serving"
        load = Load(old.url).start()
        time.sleep(2)
        new, new_ctl, _ = _engine(launch, listener, tmp_path, "new", "--share-cores-with", str(old.proc.pid))
        assert control.request(new_ctl, "state")["state"] == "serving"
        time.sleep(1)  # both engines accept
        with httpx.Client(base_url=old.url) as kept:
            assert kept.get("/v1/models").status_code == 200  # a kept-alive connection, to either engine
            reply = control.request(old_ctl, "drain_exit", timeout_s=30, successor_serving=True)
            assert reply["ok"] is True
            assert old.proc.wait(40) == 0
            time.sleep(2)
            r = kept.get("/v1/models")  # on a connection the old engine closed, the client simply reconnects
            assert r.status_code == 200
        records = load.stop()
        counts = tally(records)
        print(f"handover under load: {dict(counts)}")
        assert counts["ok"] > 100 and set(counts) == {"ok"}, [r for r in records if r.outcome != "ok"][:5]
        assert "handover_finished" in old.log() and '"handed_over": true' in old.log()
        assert InflightFile.read(old_inflight) == (0, 0)
        assert new.proc.poll() is None
        full = _shared(new.log())[0]["of"]
        assert [(e["torch_threads"], e["reason"]) for e in _shared(new.log())] == [
            (max(1, full // 2), "sharing with the engine being replaced"),
            (full, f"engine {old.proc.pid} has exited"),
        ]
        assert [(e["torch_threads"], e["reason"]) for e in _shared(old.log())] == [
            (max(1, full - full // 2), "handing over to a successor that serves")
        ]
        print(
            f"model threads: the new engine {full // 2 or 1} beside the old one, then {full}; "
            f"the old one {full - full // 2}"
        )
    finally:
        listener.close()


def test_stop_now_answers_in_flight_requests_with_a_retryable_503(launch, tmp_path):
    listener = _held_socket()
    try:
        server, ctl, inflight = _engine(launch, listener, tmp_path, "e")
        body = {"model": "pagekeeper-default", "prompt": "Errors should", "max_tokens": 200, "ignore_eos": True}
        with (
            httpx.Client(base_url=server.url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream,
        ):
            lines = stream.iter_lines()
            first = next(lines)
            assert first.startswith("data: {")
            control.request(ctl, "stop_now")
            rest = list(lines)
        assert any('"code":"engine_restarting"' in line for line in rest), rest[-3:]
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        assert server.proc.wait(20) == 0
        assert InflightFile.read(inflight) == (0, 1)  # one request failed by the stop, counted
    finally:
        listener.close()


def test_a_resumed_engine_reads_requests_that_arrived_while_it_was_stopped(launch):
    """SIGSTOP, then SIGCONT: overdue keep-alive timers run before the loop reads what arrived meanwhile
    (an interrupted select() past its deadline returns nothing); closing those connections would reset
    requests that were sent in time.  The keep-alive timeout now leaves a connection with unread data."""
    server = launch()
    load = Load(server.url).start()
    time.sleep(2)
    os.kill(server.proc.pid, signal.SIGSTOP)
    time.sleep(7)  # longer than uvicorn's 5 s keep-alive timeout
    os.kill(server.proc.pid, signal.SIGCONT)
    time.sleep(3)
    records = load.stop()
    counts = tally(records)
    print(f"SIGSTOP 7 s, SIGCONT: {dict(counts)}")
    assert set(counts) == {"ok"}, [r for r in records if r.outcome != "ok"][:5]
