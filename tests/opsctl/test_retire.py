"""Retiring an engine that dies first still counts what it had in flight.

The process here stands where an engine would: it publishes its in-flight count through the engine's own
`InflightFile` and dies by SIGKILL, the way an engine killed during a handover (kill -9, the OOM killer) leaves it.
Whoever notices the death first cleans up the engine's files (the supervisor's poll); the restart that retires it
afterwards must still count the requests as lost, not report a clean handover.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from engine.ops_contract.inflight import InflightFile
from opsctl.launcher import EngineProcess, ProcessLauncher, Retired

PUBLISH_AND_DIE = textwrap.dedent(
    """
    import os, signal, sys
    from engine.ops_contract.inflight import InflightFile
    counter = InflightFile(sys.argv[1])
    counter.set(int(sys.argv[2]))
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _dead_engine(tmp_path: Path, in_flight: int) -> EngineProcess:
    inflight = tmp_path / "eng.inflight"
    popen = subprocess.Popen([sys.executable, "-c", PUBLISH_AND_DIE, str(inflight), str(in_flight)])
    assert popen.wait(60) == -signal.SIGKILL
    return EngineProcess(popen.pid, tmp_path / "eng.sock", inflight, popen)


def test_an_engine_dead_before_it_is_retired_counts_its_in_flight_as_engine_exited(tmp_path: Path) -> None:
    engine = _dead_engine(tmp_path, 8)
    engine.cleanup()  # the supervisor's poll saw the exit first and removed the files
    assert not engine.inflight_path.exists()
    retired = ProcessLauncher.retire(engine, drain=True, timeout=5, successor_serving=True)
    print(f"lost: {retired.lost_by_reason}")
    assert retired.lost_by_reason == {"engine_exited": 8} and retired.lost == 8


def test_an_engine_that_dies_with_nothing_in_flight_costs_nothing(tmp_path: Path) -> None:
    retired = ProcessLauncher.retire(_dead_engine(tmp_path, 0), drain=False, timeout=0)
    assert retired.lost_by_reason == {} and retired.lost == 0


def test_retired_keeps_each_reason_apart() -> None:
    retired = Retired.of(no_drain=3, engine_exited=0, killed=2)
    assert retired.lost_by_reason == {"no_drain": 3, "killed": 2} and retired.lost == 5


def test_the_counters_survive_cleanup_only_once_the_engine_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "live.inflight"
    live = InflightFile(path)
    live.set(4)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        engine = EngineProcess(sleeper.pid, tmp_path / "live.sock", path, sleeper)
        assert engine.in_flight() == 4
        live.set(2)
        assert engine.in_flight() == 2  # read live while it runs, never a stale snapshot
    finally:
        sleeper.kill()
        sleeper.wait(10)
    engine.cleanup()
    assert engine.in_flight() == 2 and not path.exists()
