"""The supervisor's control socket: a reply being written when the supervisor exits still reaches its client (CI
saw `opsctl stop` told "the supervisor closed the connection without answering": the stop's reply is written by a
handler thread after the loop ended, and the process exited first)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from opsctl import control
from opsctl.constants import SOCKET_NAME
from opsctl.control_server import close_control, serve_control


def test_a_reply_still_being_written_at_close_reaches_its_client(tmp_path: Path) -> None:
    loop_done = threading.Event()

    def submit(name: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        loop_done.set()  # like the daemon: the loop has finished the stop, the handler has yet to write the reply
        time.sleep(0.5)
        return {"ok": True, "ran": name}

    server = serve_control(submit, tmp_path / SOCKET_NAME)
    replies: list[dict[str, Any]] = []
    client = threading.Thread(target=lambda: replies.append(control.send(tmp_path, "stop", timeout=10)))
    client.start()
    assert loop_done.wait(10)
    assert close_control(server, grace_s=5.0) == 0  # waits for the one reply in flight
    client.join(10)
    assert replies == [{"ok": True, "ran": "stop"}]


def test_close_waits_no_longer_than_its_grace_for_a_handler_that_never_answers(tmp_path: Path) -> None:
    release = threading.Event()
    entered = threading.Event()

    def submit(name: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        entered.set()
        release.wait(30)
        return {"ok": True}

    server = serve_control(submit, tmp_path / SOCKET_NAME)
    client = threading.Thread(target=lambda: control.send(tmp_path, "restart", timeout=30), daemon=True)
    client.start()
    assert entered.wait(10)
    started = time.monotonic()
    assert close_control(server, grace_s=0.5) == 1
    assert time.monotonic() - started < 5
    release.set()
