"""A SIGTERM the moment the `serving` line appears drains and exits 0: the line used to be said before uvicorn set its
signal handlers, and such a SIGTERM met the default action (exit -15, nothing drained; 8 of 8 tries)."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.server.harness import free_port


def test_a_sigterm_right_after_serving_is_a_drain_not_a_kill() -> None:
    codes = []
    for _ in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.server", "--port", str(free_port())],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                if '"event": "serving"' in line:
                    proc.send_signal(signal.SIGTERM)
                    break
            rest = proc.stdout.read()
            codes.append(proc.wait(timeout=60))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert '"event": "stopped"' in rest, rest[-2000:]
    assert codes == [0, 0]
