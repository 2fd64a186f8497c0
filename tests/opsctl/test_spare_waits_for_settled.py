"""A spare starts once the engine it stands behind has settled (its graphs captured, its kernels warmed), or at the
latest SPARE_SETTLE_MAX_S after the supervisor saw it serving: a spare's start beside an engine's first requests took
device time from them.  The engine end is a real control socket (engine/server/control.py) answering `state`."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from engine.lifecycle import Lifecycle, Phase
from engine.ops_contract.control import request
from engine.server.control import ControlSocket
from opsctl import launcher as launcher_module
from opsctl.launcher import EngineProcess, ProcessLauncher


@pytest.fixture
def engine_end(tmp_path):
    """A control socket as a serving engine's front has it, with `settled` read from a flag the test moves."""
    listen = socket.socket()
    lifecycle = Lifecycle()
    control = ControlSocket(tmp_path / "engine.sock", listen, lifecycle)
    flag = {"settled": False}
    control.set_settled_reader(lambda: flag["settled"])
    yield control, lifecycle, flag
    control.close()
    listen.close()


def test_the_state_reply_says_settled_only_while_serving_with_its_start_up_work_done(engine_end):
    control, lifecycle, flag = engine_end
    assert request(control.path, "state")["settled"] is False  # loading
    lifecycle.move(Phase.SERVING)
    assert request(control.path, "state")["settled"] is False  # graphs still to capture
    flag["settled"] = True
    assert request(control.path, "state")["settled"] is True
    lifecycle.move(Phase.DRAINING)
    assert request(control.path, "state")["settled"] is False


def test_the_supervisor_starts_a_spare_once_the_engine_settles_or_the_wait_runs_out(tmp_path, engine_end, monkeypatch):
    control, lifecycle, flag = engine_end
    monkeypatch.setattr(launcher_module, "SPARE_SETTLE_MAX_S", 1.5)
    launch = ProcessLauncher([], "127.0.0.1", 0, tmp_path, tmp_path / "engine.log", overlap=False, spare=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    spawned: list[int | None] = []

    def spawn(beside=None, standby_after=None, spare=False):  # the spare's own start is tested in test_keeper.py
        spawned.append(standby_after)
        return EngineProcess(sleeper.pid, tmp_path / "spare.sock", tmp_path / "spare.inflight", sleeper)

    monkeypatch.setattr(launch, "_spawn", spawn)
    try:
        launch.engine = EngineProcess(sleeper.pid, control.path, tmp_path / "engine.inflight", sleeper)
        launch.maintain()
        assert spawned == []  # loading: no spare
        lifecycle.move(Phase.SERVING)
        launch.maintain()
        assert spawned == []  # serving, start-up work pending
        flag["settled"] = True
        launch.maintain()
        assert spawned == [sleeper.pid]  # settled: the spare starts behind it

        launch.spare = None  # the spare went (promoted or died); the next engine never settles
        launch.engine = EngineProcess(sleeper.pid + 1, control.path, tmp_path / "e2.inflight", sleeper)
        flag["settled"] = False
        started = time.monotonic()
        launch.maintain()
        assert spawned == [sleeper.pid]
        while len(spawned) < 2 and time.monotonic() - started < 30:
            time.sleep(0.1)
            launch.maintain()
        waited = time.monotonic() - started
        assert spawned == [sleeper.pid, sleeper.pid + 1] and 1.4 <= waited < 30, (spawned, waited)
    finally:
        launch.spare = None
        launch.engine = None
        sleeper.kill()
        launch.close()
