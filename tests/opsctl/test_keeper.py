"""The supervisor's weights keeper (opsctl/keeper.py) with real processes: engines map the kept weights, a restart
stands the new engine by until the old one leaves, and a dead keeper degrades to cold starts, never an outage.

On the CPU with `keep_weights = "on"` and `handover = "sequential"`: the path a GPU deployment takes by default
(where two engines' KV caches do not fit), with shared-memory handles in place of CUDA IPC.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.opsctl.load import Load

pytestmark = pytest.mark.slow


def _events(d, name: str) -> list[dict]:  # type: ignore[no-untyped-def]
    out = []
    for line in d.log("engine.log").splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            event = json.loads(line)
            if event.get("event") == name:
                out.append(event)
    return out


def _assert_gone(pid: int, why: str, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(why)


def _serving_new(d, old_pid: int):  # type: ignore[no-untyped-def]
    return lambda s: s["engine"]["pid"] not in (None, old_pid) and s["engine"]["state"] == "serving"


def test_engines_share_the_kept_weights_through_restarts_kills_and_a_dead_keeper(deploy):
    d = deploy(
        supervisor={"keep_weights": "on", "handover": "sequential", "spare_engine": "off", "cooldown_seconds": 60.0}
    )
    r = d.opsctl("start")
    assert r.returncode == 0, r.stdout + r.stderr + d.log("supervisor.log")[-3000:]
    status = d.status()
    assert status["supervisor"]["handover"] == "standby"
    keeper = status["supervisor"]["weights_keeper"]
    assert keeper["state"] == "ready" and keeper["pid"] and keeper["starts"] == 1
    assert _events(d, "engine_ready")[-1]["weights_from"] == "keeper"

    # A restart under load: the new engine maps the weights while the old one serves, then waits for its exit.
    load = Load(d.url).start()
    try:
        time.sleep(2)
        old = d.engine_pid()
        r = d.opsctl("restart")
        assert r.returncode == 0, r.stdout + r.stderr
        d.wait_for(_serving_new(d, old), 120, "the new engine serving")
        time.sleep(2)
    finally:
        records = load.stop()
    failed = [x for x in records if x.outcome != "ok"]
    assert not failed, failed[:5]
    ready = _events(d, "engine_ready")[-1]
    assert ready["weights_from"] == "keeper" and "standby" in ready["phases"]
    assert '"engine_standing_by"' in d.log("supervisor.log")

    # kill -9 of the engine: its successor maps the same kept weights (the keeper is not the engine's child).
    old = d.engine_pid()
    os.killpg(old, signal.SIGKILL)
    d.wait_for(_serving_new(d, old), 120, "the engine restarted after kill -9")
    assert _events(d, "engine_ready")[-1]["weights_from"] == "keeper"
    assert d.status()["supervisor"]["weights_keeper"]["pid"] == keeper["pid"]

    # kill -9 of the keeper: the running engine keeps serving; the next restart is a cold one, and a new keeper
    # is started once the old engine is gone (never beside it).
    os.kill(keeper["pid"], signal.SIGKILL)
    time.sleep(0.5)
    old = d.engine_pid()
    r = d.opsctl("restart")
    assert r.returncode == 0, r.stdout + r.stderr
    d.wait_for(_serving_new(d, old), 120, "the engine restarted after the keeper died")
    now = d.status()["supervisor"]["weights_keeper"]
    assert now["starts"] == 2 and now["pid"] != keeper["pid"]

    # opsctl stop ends the keeper too: its memory goes back
    pid = now["pid"]
    assert d.opsctl("stop").returncode == 0
    _assert_gone(pid, "the keeper outlived opsctl stop")


def test_a_spare_engine_stands_by_and_takes_over_a_killed_or_restarted_engine(deploy):
    """The spare has done everything but the KV cache: kill -9 of the engine wakes it by itself (the supervisor only
    promotes it), and a restart's drain hands over to it; a new spare then stands behind the new engine."""
    d = deploy(supervisor={"keep_weights": "on", "handover": "sequential", "spare_engine": "on"})
    r = d.opsctl("start")
    assert r.returncode == 0, r.stdout + r.stderr + d.log("supervisor.log")[-3000:]
    spare, _ = d.wait_for(lambda s: (s["supervisor"]["spare_engine"] or {}).get("state") == "standby", 90, "a spare")
    spare_pid = spare["supervisor"]["spare_engine"]["pid"]

    old = d.engine_pid()
    killed = time.monotonic()
    os.killpg(old, signal.SIGKILL)
    status, _ = d.wait_for(_serving_new(d, old), 90, "the spare serving after kill -9")
    took = time.monotonic() - killed
    assert status["engine"]["pid"] == spare_pid, "the spare was promoted, not a new engine started"
    print(f"kill -9: the spare served again {took:.1f} s after the kill")
    ready = _events(d, "engine_ready")[-1]
    assert ready["weights_from"] == "keeper" and ready["phases"]["standby"] > 0

    again, _ = d.wait_for(
        lambda s: (
            (s["supervisor"]["spare_engine"] or {}).get("state") == "standby"
            and s["supervisor"]["spare_engine"]["pid"] != spare_pid
        ),
        90,
        "a new spare behind the promoted engine",
    )
    spare_pid = again["supervisor"]["spare_engine"]["pid"]
    load = Load(d.url).start()
    try:
        time.sleep(2)
        old = d.engine_pid()
        assert d.opsctl("restart").returncode == 0
        status, _ = d.wait_for(_serving_new(d, old), 90, "the spare serving after a restart")
        time.sleep(2)
    finally:
        records = load.stop()
    assert status["engine"]["pid"] == spare_pid
    failed = [x for x in records if x.outcome != "ok"]
    assert not failed, failed[:5]

    keeper = d.status()["supervisor"]["weights_keeper"]["pid"]
    d.wait_for(lambda s: (s["supervisor"]["spare_engine"] or {}).get("state") == "standby", 90, "a third spare")
    spare_pid = d.status()["supervisor"]["spare_engine"]["pid"]
    assert d.opsctl("stop").returncode == 0
    for pid in (spare_pid, keeper):
        _assert_gone(pid, f"pid {pid} outlived opsctl stop")
