"""The engine states `opsctl status` reports: derived in one place, their exit codes, their transitions."""

from __future__ import annotations

from opsctl.state import BUSY, LIVE, EngineState, StateTracker, allowed, derive

S = EngineState


def state(**kw) -> EngineState:
    base = dict(gave_up=False, permanent=False, busy=None, alive=True, ready=True, health="ok")
    return derive(**{**base, **kw})


def test_derive_precedence():
    assert state() == S.SERVING
    assert state(health="draining") == S.DRAINING and state(health="stalled") == S.STALLED
    assert state(health="timeout") == S.UNRESPONSIVE and state(health="unknown") == S.UNRESPONSIVE
    assert state(ready=False, health="timeout") == S.STARTING
    assert state(alive=False, ready=False) == S.EXITED
    assert state(busy=S.RESTARTING, alive=False) == S.RESTARTING
    assert state(gave_up=True, busy=S.STOPPING) == S.GAVE_UP
    assert state(gave_up=True, permanent=True) == S.FAILED


def test_exit_codes_match_the_documented_table():
    want = {
        "serving": 0,
        "starting": 4,
        "restarting": 4,
        "recycling": 0,
        "stopping": 4,
        "draining": 5,
        "gave_up": 6,
        "failed": 6,
        "exited": 8,
        "stalled": 8,
        "unresponsive": 8,
        "not_running": 3,
        "unsupervised": 7,
    }
    assert {s.value: s.exit_code for s in EngineState} == want


def test_transitions():
    assert all(allowed(a, b) for a in LIVE for b in LIVE | BUSY | {S.GAVE_UP, S.FAILED})
    assert allowed(S.GAVE_UP, S.RESTARTING) and not allowed(S.GAVE_UP, S.SERVING)
    assert not allowed(S.FAILED, S.STARTING) and not allowed(S.RESTARTING, S.GAVE_UP)
    # a stop is final; a retired engine (`opsctl retire`, a pod's preStop) can only be restarted
    assert [s for s in EngineState if s != S.STOPPING and allowed(S.STOPPING, s)] == [S.RESTARTING]
    tracker = StateTracker()
    assert tracker.update(S.STARTING) == S.STARTING and tracker.update(S.GAVE_UP) == S.GAVE_UP
    assert tracker.update(S.SERVING) == S.SERVING  # reported even when unexpected (and warned about)
