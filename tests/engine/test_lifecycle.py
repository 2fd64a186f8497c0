"""The engine's one lifecycle state (engine/lifecycle.py): allowed moves, listeners, and the standby wait."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from engine import lifecycle
from engine.lifecycle import Lifecycle, Phase


def test_moves_follow_the_diagram_and_listeners_hear_each_change():
    lc = Lifecycle()
    heard: list[tuple[str, str]] = []
    lc.listen(lambda old, new: heard.append((old.value, new.value)))
    assert lc.move(Phase.SERVING) and not lc.move(Phase.SERVING)  # a repeat is no change
    lc.move(Phase.RECYCLING)
    lc.move(Phase.SERVING)
    lc.move(Phase.DRAINING)
    lc.move(Phase.SERVING)  # resume
    lc.move(Phase.HANDING_OVER)
    with pytest.raises(ValueError, match="handing_over -> serving"):
        lc.move(Phase.SERVING)  # an engine that gave its socket away never serves again
    lc.move(Phase.STOPPING)
    assert heard == [
        ("loading", "serving"),
        ("serving", "recycling"),
        ("recycling", "serving"),
        ("serving", "draining"),
        ("draining", "serving"),
        ("serving", "handing_over"),
        ("handing_over", "stopping"),
    ]
    assert Phase.RECYCLING.admits and not Phase.DRAINING.admits and Phase.HANDING_OVER.leaving


def test_stopping_is_always_allowed_and_final():
    lc = Lifecycle()
    lc.move(Phase.STOPPING)  # from loading: a second signal while the model loads
    with pytest.raises(ValueError):
        lc.move(Phase.SERVING)


def test_wait_until_wakes_on_the_change():
    lc = Lifecycle()
    threading.Timer(0.2, lambda: lc.move(Phase.SERVING)).start()
    started = time.monotonic()
    assert lc.wait_until(lambda p: p == Phase.SERVING, timeout=5)
    assert time.monotonic() - started < 4
    assert not lc.wait_until(lambda p: p == Phase.STOPPING, timeout=0.05)


def test_standby_waits_for_the_predecessor_to_exit_and_says_so(monkeypatch):
    lc = Lifecycle()
    monkeypatch.setattr(lifecycle, "LIFECYCLE", lc)
    heard: list[str] = []
    lc.listen(lambda old, new: heard.append(new.value))
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    waited = lifecycle.standby_until_exit(old.pid)
    old.wait()
    assert 0.2 < waited < 10
    assert heard == ["standby", "loading"]
    assert lifecycle.standby_until_exit(old.pid) == 0.0  # gone (reaped): nothing to wait for
    forever = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError, match="did not exit"):
            lifecycle.standby_until_exit(forever.pid, limit_s=0.2)
        assert lc.phase == Phase.LOADING
    finally:
        forever.kill()
        forever.wait()


def test_standby_also_waits_for_the_processes_under_the_predecessor(monkeypatch):
    """A killed engine's core (or tensor-parallel rank) holds the device a moment longer than the engine itself:
    its successor must not take memory before it is gone too."""
    lc = Lifecycle()
    monkeypatch.setattr(lifecycle, "LIFECYCLE", lc)
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1.5)'])\n"
        "time.sleep(0.5)\n"
    )  # the predecessor leaves after 0.5 s; its child lives until 1.5 s
    old = subprocess.Popen([sys.executable, "-c", code])
    started = time.monotonic()
    timings: dict[str, float] = {}
    lifecycle.standby_until_exit(old.pid, timings=timings)
    waited = time.monotonic() - started
    old.wait()
    assert waited > 1.2, f"the standby ended after {waited:.2f} s, before the predecessor's child exited"
    assert waited < 10
    # the split the successor logs (standby_ended): the child outlived the predecessor by about a second
    assert timings["released"] == 0.0 and 0.5 < timings["after_pid_s"] < waited


ANNOUNCES = (
    "import subprocess, sys, time\n"
    "from engine.lifecycle import announce_released\n"
    "child = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
    "time.sleep(0.3)\n"
    "assert announce_released(4096)\n"
    "time.sleep(30)\n"
)
CHILD_ANNOUNCES = (
    "from engine.lifecycle import announce_released; import time; time.sleep(0.6); announce_released(0); time.sleep(30)"
)


def test_processes_that_announced_their_memory_free_are_not_waited_for(monkeypatch, tmp_path):
    """A predecessor (and the processes under it: its core, its ranks) that freed its device memory and said so
    (engine/runner/release.py) counts as gone while its exit's teardown still runs; one that did not is waited for."""
    import os
    from pathlib import Path

    monkeypatch.setenv("PAGEKEEPER_CACHE_DIR", str(tmp_path))
    lc = Lifecycle()
    monkeypatch.setattr(lifecycle, "LIFECYCLE", lc)
    env = {**os.environ, "PYTHONPATH": str(Path(lifecycle.__file__).parents[1])}
    old = subprocess.Popen([sys.executable, "-c", ANNOUNCES.format(child=CHILD_ANNOUNCES)], env=env)
    try:
        waited = lifecycle.standby_until_exit(old.pid, limit_s=20)
        assert old.poll() is None  # still running: its announcement (and its child's) ended the wait
        assert 0.5 < waited < 10, waited
        marker = lifecycle.released_marker(old.pid)
        assert marker is not None and marker.exists() and '"held_bytes": 4096' in marker.read_text()
    finally:
        for p in __import__("psutil").Process(old.pid).children(recursive=True):
            p.kill()
        old.kill()
        old.wait()
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError, match="did not exit"):
            lifecycle.standby_until_exit(silent.pid, limit_s=0.6)
    finally:
        silent.kill()
        silent.wait()


def test_a_marker_names_one_process_not_a_later_one_with_its_pid(monkeypatch, tmp_path):
    """The marker's name carries the process's start time: a pid the kernel gives again is not taken as released,
    and writing a marker prunes those of processes that are gone."""
    import os

    monkeypatch.setenv("PAGEKEEPER_CACHE_DIR", str(tmp_path))
    marker = lifecycle.released_marker(os.getpid())
    assert marker is not None
    stale = marker.parent / f"{os.getpid()}-1"  # this pid, another start time
    gone = marker.parent / "999999999-5"
    marker.parent.mkdir(parents=True)
    stale.write_text("{}")
    gone.write_text("{}")
    assert not lifecycle._released(os.getpid())
    assert lifecycle.announce_released(0) and lifecycle._released(os.getpid())
    assert not stale.exists() and not gone.exists()
    marker.unlink()


def test_a_standby_that_is_promoted_retracts_its_marker(monkeypatch, tmp_path):
    """A spare standing by announces that it holds nothing (engine/runner/release.py); once promoted it takes device
    memory, and from then on whoever waits for it must wait again."""
    import os

    monkeypatch.setenv("PAGEKEEPER_CACHE_DIR", str(tmp_path))
    assert lifecycle.announce_released(0) and lifecycle._released(os.getpid())
    lifecycle.retract_released()
    assert not lifecycle._released(os.getpid())
    lifecycle.retract_released()  # twice is harmless


def test_a_standby_is_released_while_it_stands_by_taken_back_when_promoted_kept_when_it_leaves(monkeypatch, tmp_path):
    """The marker a spare writes while it stands by (engine/runner/release.py): gone once it is promoted (it takes
    memory then), still there when it leaves on an error (killed with its front: nobody waits for its exit)."""
    import os

    import torch

    from engine.runner.release import released_while_standing_by

    monkeypatch.setenv("PAGEKEEPER_CACHE_DIR", str(tmp_path))
    with released_while_standing_by(torch.device("cpu")):
        assert lifecycle._released(os.getpid())
    assert not lifecycle._released(os.getpid())
    with pytest.raises(SystemExit):
        with released_while_standing_by(torch.device("cpu")):
            raise SystemExit("the supervisor is gone")
    assert lifecycle._released(os.getpid())
    lifecycle.retract_released()


@pytest.mark.gpu
def test_on_a_gpu_a_standby_is_released_while_it_stands_by_and_not_after(monkeypatch, tmp_path):
    import os

    import torch

    from engine.runner.release import released_while_standing_by

    monkeypatch.setenv("PAGEKEEPER_CACHE_DIR", str(tmp_path))
    scratch = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del scratch  # cached by the allocator: the context manager returns it to the driver first
    with released_while_standing_by(torch.device("cuda")):
        assert lifecycle._released(os.getpid())
        assert torch.cuda.memory_reserved() == 0
    assert not lifecycle._released(os.getpid())  # promoted: it holds memory again
    with pytest.raises(SystemExit):  # its supervisor gone: it leaves, and nobody waits for its exit
        with released_while_standing_by(torch.device("cuda")):
            raise SystemExit("gone")
    assert lifecycle._released(os.getpid())
    lifecycle.retract_released()


def test_a_process_knows_its_age_to_the_clock_tick():
    """A fresh interpreter's age as it reports it is what its parent measured (psutil's create_time, which adds the
    boot time in whole seconds, was up to a second off: the start-up timeline's `interpreter` read 0.86 s for 0.2)."""
    import subprocess
    import sys
    import time

    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", "from engine.lifecycle import process_age_s; print(process_age_s())"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    elapsed = time.monotonic() - started
    age = float(out.stdout)
    assert 0.0 <= age <= elapsed + 0.03, (age, elapsed)
