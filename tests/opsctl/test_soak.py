"""Healthy steady load for ten minutes at a 1 s poll: the supervisor takes no action.

The load runs in its own process from the session's first test on (tests/conftest.py,
tests/opsctl/soak.py), so the ten minutes overlap the rest of the suite; this check runs last and
waits for whatever is left.  The policy uses its default thresholds; only the poll (1 s) and the
cooldown (5 s, so that nearly all ten minutes are judged) are set.
"""

from __future__ import annotations

import json
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.soak]


def test_ten_minutes_of_healthy_load_cause_no_policy_action(background_soak):
    out = background_soak.out
    returncode = background_soak.wait(deadline=time.monotonic() + 900)  # it may have started on another xdist worker
    log = background_soak.log.read_text(errors="replace")
    assert returncode == 0 and out.exists(), f"exit status {returncode}\n{log[-3000:]}"
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
