"""A spare engine that never stands by (a rank stuck in a collective another rank never joins: seen at TP=4) does
not hold a restart hostage: past SPARE_READY_S from its start it is stopped and the restart goes on without it."""

from __future__ import annotations

import subprocess
import sys
import time

from structlog.testing import capture_logs

from opsctl import launcher as launcher_module
from opsctl.launcher import EngineProcess, ProcessLauncher


def test_a_spare_that_never_stands_by_is_stopped_and_not_waited_for(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher_module, "SPARE_READY_S", 1.0)
    launch = ProcessLauncher([], "127.0.0.1", 0, tmp_path, tmp_path / "engine.log", overlap=False, spare=True)
    # a process that never answers on its control socket: its state stays unknown, never "standby"
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        launch.spare = EngineProcess(stuck.pid, tmp_path / "none.sock", tmp_path / "none.inflight", stuck)
        started = time.monotonic()
        with capture_logs() as logs:
            standing = launch._spare_standing_by(timeout=600)
        waited = time.monotonic() - started
        assert standing is False and waited < 30, waited
        assert launch.spare is None and stuck.wait(30) is not None, "the stuck spare was not stopped"
        assert [e for e in logs if e["event"] == "spare_engine_not_ready"]
    finally:
        if stuck.poll() is None:
            stuck.kill()
        launch.close()
