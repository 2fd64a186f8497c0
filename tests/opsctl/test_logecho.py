"""opsctl/logecho.py: the engine's log file reaches stdout as JSON lines, through rotations, from where it stood."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

from opsctl.logecho import LogEcho
from opsctl.logrotate import rotate_if_large


def _wait_for(out: io.StringIO, n: int, timeout: float = 5.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [json.loads(ln) for ln in out.getvalue().splitlines()]  # every line is JSON
        if len(lines) >= n:
            return lines
        time.sleep(0.02)
    raise AssertionError(f"expected {n} lines, got: {out.getvalue()!r}")


def test_echoes_new_lines_as_json_through_a_rotation(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text('{"event": "before the supervisor started"}\n')
    out = io.StringIO()
    echo = LogEcho(log, out, interval_s=0.02).start()
    try:
        with open(log, "a") as f:
            f.write('{"event": "engine_ready", "level": "info"}\n--- engine start 2026-11-24T09:00:00 ---\nTraceb')
            f.flush()
            lines = _wait_for(out, 2)
            f.write("ack (most recent call last):\n")
            f.flush()
            lines = _wait_for(out, 3)
        assert lines[0] == {"event": "engine_ready", "level": "info"}  # the engine's own JSON, as it is
        assert lines[1]["line"] == "--- engine start 2026-11-24T09:00:00 ---" and lines[1]["event"] == "engine_output"
        assert lines[2]["line"] == "Traceback (most recent call last):"  # a line split across two writes is one line
        # appended, as the engine writes (Path.write_bytes would truncate first: a poll that saw the empty file
        # took it for a rotation, and the line was lost in one suite run under load)
        with open(log, "ab") as f:
            f.write(b"x" * 5000 + b"\n")
        assert rotate_if_large(log, 4096, 1)  # copied to .1 and truncated in place, as the supervisor rotates
        with open(log, "a") as f:
            f.write('{"event": "after the rotation"}\n')
        lines = _wait_for(out, 5)
        assert lines[3]["line"] == "x" * 5000  # written just before the rotation: echoed from engine.log.1
        assert lines[4] == {"event": "after the rotation"}
    finally:
        echo.stop()
    assert not any("before the supervisor started" in json.dumps(x) for x in lines)
    print(f"echoed {len(lines)} lines, all JSON")
