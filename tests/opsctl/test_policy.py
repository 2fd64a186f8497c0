"""Must-show 1: each rule fires exactly when it should — not on a single spike, not during
cooldown, not after giving up — over synthetic observation traces."""

from __future__ import annotations

from opsctl.policy import Observation, PolicyConfig, PolicyState, decide

CFG = PolicyConfig(hang_seconds=30, cooldown_seconds=60, event_window=300, events_to_act=3,
                   fragmentation_window=600, max_restarts=3, restart_window=600, ready_timeout=120)
READY = PolicyState(started_at=0.0, ready_at=10.0)


def obs(t: float, **kw) -> Observation:
    base = dict(process_alive=True, health="ok", cache_usage=0.5, running=4, waiting=0, steps_total=t * 10,
                allocator_efficiency=0.95)
    return Observation(t=t, **{**base, **kw})


def run(trace: list[Observation], state: PolicyState = READY, cfg: PolicyConfig = CFG):
    """Decisions at every poll of the trace, as the supervisor would take them."""
    return [decide(trace[: i + 1], state, cfg, o.t) for i, o in enumerate(trace)]


def test_healthy_trace_never_acts():
    trace = [obs(100 + 10 * i) for i in range(100)]
    assert all(not a.acts for a in run(trace))


def test_high_cache_needs_three_events_in_the_window():
    trace = [obs(100), obs(110, cache_usage=0.97), obs(120), obs(130, cache_usage=0.99), obs(140),
             obs(150, cache_usage=0.96)]
    actions = run(trace)
    assert [a.kind for a in actions] == ["none"] * 5 + ["drain_restart"]
    assert actions[-1].reason == "high_cache"
    assert actions[-1].evidence["high_cache_events"] == 3 and actions[-1].evidence["peak_cache_usage"] == 0.99


def test_a_single_spike_does_not_act_even_with_both_conditions():
    assert not decide([obs(100, cache_usage=1.0, waiting=50, running=1)], READY, CFG, 100).acts


def test_events_outside_the_window_do_not_count():
    trace = [obs(100, cache_usage=0.99), obs(200, cache_usage=0.99), obs(450), obs(460, cache_usage=0.99)]
    assert not decide(trace, READY, CFG, 460).acts  # the first event is 360 s old
    assert decide(trace[:2] + [obs(210, cache_usage=0.99)], READY, CFG, 210).kind == "drain_restart"


def test_backlog_counts_and_empty_queues_do_not():
    trace = [obs(100 + i, waiting=9, running=4) for i in range(3)]
    a = decide(trace, READY, CFG, 102)
    assert a.kind == "drain_restart" and a.reason == "backlog"
    idle = [obs(100 + i, waiting=0, running=0) for i in range(10)]
    assert not decide(idle, READY, CFG, 109).acts  # 0 > 2 x 0 is not a backlog


def test_hang_by_health_waits_for_hang_seconds_and_skips_the_drain():
    trace = [obs(100), obs(110, health="timeout"), obs(120, health="timeout"), obs(130, health="stalled"),
             obs(140, health="timeout")]
    actions = run(trace)
    # the clock runs from the last good answer (t=100): no answer for 30 s at t=130
    assert [a.kind for a in actions] == ["none"] * 3 + ["restart"] * 2
    assert actions[3].reason == "hang" and actions[3].evidence["for_s"] == 30


def test_hang_by_frozen_steps_while_requests_wait():
    trace = [obs(100 + 10 * i, steps_total=500, waiting=1, running=2) for i in range(4)]
    assert decide(trace[:3], READY, CFG, 120).kind == "none"  # frozen for 20 s only
    a = decide(trace, READY, CFG, 130)
    assert a.kind == "restart" and a.reason == "hang" and a.evidence["steps_total"] == 500
    idle = [obs(100 + 10 * i, steps_total=500, waiting=0, running=0) for i in range(10)]
    assert not decide(idle, READY, CFG, 190).acts  # an idle engine may keep its step count


def test_a_brief_outage_is_not_a_hang():
    trace = [obs(100, health="timeout"), obs(110, health="timeout"), obs(120), obs(130, health="timeout"),
             obs(140, health="timeout"), obs(150)]
    assert all(not a.acts for a in run(trace))


def test_nothing_but_exits_during_start_and_cooldown():
    starting = PolicyState(started_at=100.0)
    trace = [obs(100 + 10 * i, health="unreachable", cache_usage=None) for i in range(8)]
    assert [a.reason for a in run(trace, starting)] == ["starting"] * 8
    cooling = PolicyState(started_at=0.0, ready_at=95.0)
    hot = [obs(100 + 10 * i, cache_usage=0.99, waiting=10, running=1, health="stalled") for i in range(5)]
    assert all(a.reason == "cooldown" for a in run(hot, cooling))
    dead = hot + [obs(150, process_alive=False)]
    assert decide(dead, cooling, CFG, 150).reason == "engine_exited"


def test_an_engine_that_never_becomes_ready_is_restarted():
    starting = PolicyState(started_at=100.0)
    trace = [obs(100 + 10 * i, health="unreachable") for i in range(13)]
    actions = run(trace, starting)
    assert actions[-2].kind == "none" and actions[-1].reason == "start_timeout"  # at t = 220 = 100 + 120


def test_process_exit_restarts_then_crash_loop_gives_up():
    dead = [obs(500, process_alive=False, health="unreachable")]
    state = PolicyState(started_at=490.0, restarts=(300.0, 400.0))
    assert decide(dead, state, CFG, 500).kind == "restart"
    state = PolicyState(started_at=490.0, restarts=(300.0, 400.0, 480.0))
    a = decide(dead, state, CFG, 500)
    assert a.kind == "give_up" and a.reason == "crash_loop" and a.evidence["restarts_in_window"] == 3
    old = PolicyState(started_at=490.0, restarts=(-500.0, -400.0, -300.0))
    assert decide(dead, old, CFG, 500).kind == "restart"  # outside the restart window


def test_after_giving_up_nothing_happens():
    gave_up = PolicyState(started_at=0.0, ready_at=10.0, restarts=(1, 2, 3), gave_up=True)
    trace = [obs(100, process_alive=False), obs(110, cache_usage=1.0, waiting=99, running=0)]
    assert all(not a.acts for a in run(trace, gave_up))


def test_fragmentation_waits_for_the_window_and_for_low_traffic():
    trace = [obs(100 + 60 * i, allocator_efficiency=0.6, running=8, waiting=0) for i in range(12)]
    actions = run(trace)
    assert all(not a.acts for a in actions)
    assert actions[-1].reason == "fragmentation_waiting_for_low_traffic"
    quiet = trace + [obs(800, allocator_efficiency=0.6, running=1, waiting=0)]
    a = decide(quiet, READY, CFG, 800)
    assert a.kind == "drain_restart" and a.reason == "fragmentation" and a.evidence["for_s"] == 700
    recovered = trace[:-1] + [obs(760, allocator_efficiency=0.8, running=0)]
    assert not decide(recovered, READY, CFG, 760).acts
