"""The supervisor's poll period is the configured interval, not interval plus the time its probes took."""

from __future__ import annotations

import pytest

from opsctl.daemon import next_poll_at


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
