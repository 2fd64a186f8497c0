"""Healthy steady load for ten minutes at a 1 s poll: the supervisor takes no action.

The soak has a marker of its own (`soak`): README's test command leaves it out (pyproject.toml's addopts), and CI
runs it as a step of its own, README's soak command (`python3 -m pytest -m soak`), so that its ten minutes are not
the floor of every run of the suite.  The load runs in its own process (tests/opsctl/soak.py); the policy uses its
default thresholds, only the poll (1 s) and the cooldown (5 s, so that nearly all ten minutes are judged) are set.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.harness import REPO

pytestmark = [pytest.mark.slow, pytest.mark.soak]

SOAK_SECONDS = 600.0
# Each of the 8 clients pauses between requests.  Measured alone (`python -m tests.opsctl.soak --seconds 90 --pause
# P`, the engine's CPU seconds from /proc, 2026-11-27): at 1 s the soak's engine served 6.4 requests/s on 0.85 of a
# core, at 2.5 s 2.9/s on 0.3.  Beside the whole suite at 3 s a client's turn took about 3.35 s: about 1,450
# requests in ten minutes (the test wants more than 1,000; that holds while a request takes under 1.6 s on average).
SOAK_PAUSE_S = 3.0


@pytest.mark.timeout(SOAK_SECONDS + 300)
def test_ten_minutes_of_healthy_load_cause_no_policy_action(tmp_path):
    out, log = tmp_path / "soak.json", tmp_path / "soak.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.opsctl.soak", "--seconds", str(SOAK_SECONDS), "--pause", str(SOAK_PAUSE_S)]
            + ["--root", str(tmp_path / "d"), "--out", str(out)],
            cwd=str(REPO),
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        returncode = proc.wait(SOAK_SECONDS + 240)
    finally:
        if proc.poll() is None:  # killed by its group (by PID), with the deployment it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        _teardown(tmp_path / "d")
    text = log.read_text(errors="replace")
    assert returncode == 0 and out.exists(), f"exit status {returncode}\n{text[-3000:]}"
    result = json.loads(out.read_text())
    print("\n" + json.dumps(result, indent=2))
    assert "error" not in result, result
    assert result["seconds"] >= 600
    assert result["clients"] >= 8 and result["requests"] > 1000
    assert result["outcomes"] == {"ok": result["requests"]}
    # The supervisor kept polling through the load.  A poll that overruns its 1 s period (a probe may take up to
    # probe_timeout, 5 s) is followed at once but not caught up, so each overrun costs its excess: beside the suite on
    # the 2-core machine 593 polls in 607 s (supervisor-soak-cpu-2026-11-23.json, 0.976), 2.6 % from the 0.95 this
    # asserted.  That the period is 1 s whatever the probes took is checked exactly in test_poll_schedule.py.
    assert result["polls"] >= 0.9 * result["seconds"]
    assert result["decisions"] == {} and result["restarts"] == 0, result


def _teardown(root: Path) -> None:
    """What the soak deployed (the supervisor and its engine, daemonized out of the soak's process group), by PID."""
    from tests.opsctl.harness import Deployment

    try:
        info = json.loads((root / "deployment.json").read_text())
    except (OSError, ValueError):
        return
    Deployment(root, Path(info["config"]), Path(info["runtime"]), int(info["port"])).teardown()
