"""Sharing the CPU during an overlapping handover (engine/core_share.py): the new engine runs half the model
threads while the engine it replaces lives, all of them once that process has exited (a zombie counts as exited);
the old engine, handing over to a successor that serves, keeps the other half.  The predecessor is a real process."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from engine import core_share
from engine.core_share import CoreShare, process_gone


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_the_new_engine_runs_half_until_its_predecessor_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_share, "CHECK_INTERVAL_S", 0.0)
    old = _sleeper()
    try:
        share = CoreShare(full=4, predecessor=old.pid)
        share()
        assert share.applied == torch.get_num_threads() == 2
        share()
        assert torch.get_num_threads() == 2  # still there: still half
        old.kill()
        old.wait()
        share()
        assert share.applied == torch.get_num_threads() == 4 and share.predecessor is None
    finally:
        old.kill()


def test_a_zombie_predecessor_counts_as_gone() -> None:
    old = _sleeper()
    try:
        assert not process_gone(old.pid)
        old.kill()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # killed, not reaped: a zombie
            with open(f"/proc/{old.pid}/stat") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        assert process_gone(old.pid)
    finally:
        old.wait()
    assert process_gone(old.pid)


def test_the_old_engine_keeps_the_other_half_when_it_hands_over() -> None:
    share = CoreShare(full=5)
    share()
    assert torch.get_num_threads() == 5
    share.yield_to_successor()
    share()
    assert share.applied == torch.get_num_threads() == 3  # the new engine took 5 // 2 = 2


@pytest.mark.parametrize("full", [1, 2])
def test_one_thread_is_the_least_either_engine_runs(full: int) -> None:
    old = _sleeper()
    try:
        share = CoreShare(full=full, predecessor=old.pid)
        share()
        assert torch.get_num_threads() == max(1, full // 2)
    finally:
        old.kill()
        old.wait()
    leaving = CoreShare(full=full)
    leaving.yield_to_successor()
    leaving()
    assert torch.get_num_threads() == max(1, full - full // 2)
