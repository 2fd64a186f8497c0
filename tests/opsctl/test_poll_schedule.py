"""The supervisor's poll period is the configured interval, not interval plus the time its probes took."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from opsctl.config import load_config
from opsctl.daemon import Supervisor, next_poll_at
from opsctl.launcher import Launcher, Retired
from opsctl.probes import EngineProbe, FakeGpuProbe
from tests.opsctl.harness import FAST_SUPERVISOR, write_config


def test_a_poll_that_took_part_of_its_period_does_not_stretch_it() -> None:
    due, polls, sleep_after = 0.0, 0, 0
    while due < 600.0:  # a poll starts at `due`; its probes take 150 ms (a loaded host)
        polls += 1
        due = next_poll_at(due, 1.0, due + 0.15)
    t = 0.0
    while t < 600.0:  # the loop before: a full period's sleep after each poll
        sleep_after += 1
        t += 0.15 + 1.0
    print(f"\npolls started in 600 s at a 1 s period, 150 ms probes: {polls} (sleeping after each: {sleep_after})")
    assert polls == 600 and sleep_after == 522


@pytest.mark.parametrize("overrun", [1.0, 2.5, 40.0])
def test_a_poll_that_overran_is_followed_at_once_without_a_burst(overrun: float) -> None:
    due = 100.0
    now = due + overrun  # a slow probe, a drain or a restart ran inside this poll
    nxt = next_poll_at(due, 1.0, now)
    assert nxt == now
    # and the one after that is a full period later: no catching up on the missed ones
    assert next_poll_at(nxt, 1.0, nxt + 0.01) == nxt + 1.0


class _Launcher(Launcher):
    """A launcher whose engine starts and then lives until `dies_at` (time.monotonic), or is already gone."""

    name = "fake"
    exit_watch_s = 0.05

    def __init__(self, dies_at: float) -> None:
        super().__init__()
        self.dies_at = dies_at

    def alive(self) -> bool:
        return time.monotonic() < self.dies_at

    def pid(self) -> int | None:
        return 4242

    def start(self) -> None: ...
    def restart(self, drain: bool, timeout: float, ready_timeout: float) -> Retired:
        return Retired()

    def stop(self, drain: bool, timeout: float) -> Retired:
        return Retired()

    def log_path(self) -> Path | None:
        return None

    def close(self) -> None: ...


def _supervisor(tmp_path: Path, launcher: Launcher) -> Supervisor:
    cfg = load_config(write_config(tmp_path / "p.toml", {"port": 1}, {**FAST_SUPERVISOR, "poll_interval": 10.0}), {})
    gpus = tmp_path / "gpus.json"
    gpus.write_text("[]")
    return Supervisor(cfg, launcher, EngineProbe("http://127.0.0.1:1", 1.0), FakeGpuProbe(str(gpus)))


def test_a_starting_engine_that_exits_ends_the_wait_for_the_next_poll(tmp_path: Path) -> None:
    """An engine that exits 2 on a bad setting was seen only at the next poll, a probe timeout or a poll interval
    later; while an engine starts the wait checks it every exit_watch_s.  One already gone, or a supervisor that
    gave up, waits its whole time: the watch must never turn into polling without pause."""
    launcher = _Launcher(dies_at=float("inf"))
    sup = _supervisor(tmp_path, launcher)
    started = time.monotonic()
    launcher.dies_at = started + 0.3
    sup._wait_and_serve_commands(5.0)
    woke = time.monotonic() - started
    gone = _supervisor(tmp_path, _Launcher(dies_at=0.0))
    started = time.monotonic()
    gone._wait_and_serve_commands(1.0)
    waited_gone = time.monotonic() - started
    sup.state = replace(sup.state, gave_up=True)
    launcher.dies_at = time.monotonic() + 0.3
    started = time.monotonic()
    sup._wait_and_serve_commands(1.0)
    waited_gave_up = time.monotonic() - started
    print(f"woke {woke:.2f} s after a 0.3 s start; waited {waited_gone:.2f} s (gone), {waited_gave_up:.2f} s (gave up)")
    assert 0.3 <= woke < 2.0  # not the 5 s wait (margin for a loaded host)
    assert waited_gone >= 0.95 and waited_gave_up >= 0.95
