"""Must-show 1: each rule fires exactly when it should — not on a single spike, not during
cooldown, not after giving up — over synthetic observation traces."""

from __future__ import annotations

from dataclasses import replace

from opsctl.policy import Observation, PolicyConfig, PolicyState, decide

CFG = PolicyConfig(
    hang_seconds=30,
    cooldown_seconds=60,
    event_window=300,
    events_to_act=3,
    fragmentation_window=600,
    max_restarts=3,
    restart_window=600,
    ready_timeout=120,
)
READY = PolicyState(started_at=0.0, ready_at=10.0)


def obs(t: float, **kw) -> Observation:
    base = dict(
        process_alive=True,
        health="ok",
        cache_usage=0.5,
        running=4,
        waiting=0,
        steps_total=t * 10,
        allocator_efficiency=0.95,
    )
    return Observation(t=t, **{**base, **kw})


def run(trace: list[Observation], state: PolicyState = READY, cfg: PolicyConfig = CFG):
    """Decisions at every poll of the trace, as the supervisor would take them."""
    return [decide(trace[: i + 1], state, cfg, o.t) for i, o in enumerate(trace)]


def test_healthy_trace_never_acts():
    trace = [obs(100 + 10 * i) for i in range(100)]
    assert all(not a.acts for a in run(trace))


def test_high_cache_needs_three_pressure_events_in_the_window():
    # usage alone is not pressure: each event here comes with preemptions since the previous poll
    trace = [
        obs(100, preemptions=0),
        obs(110, cache_usage=0.97, preemptions=4),
        obs(120, preemptions=4),
        obs(130, cache_usage=0.99, preemptions=9),
        obs(140, preemptions=9),
        obs(150, cache_usage=0.96, preemptions=12),
    ]
    actions = run(trace)
    assert [a.kind for a in actions] == ["none"] * 5 + ["recycle"]  # the cheap cure first
    assert actions[-1].reason == "high_cache"
    ev = actions[-1].evidence
    assert ev["pressure_events"] == 3 and ev["peak_cache_usage"] == 0.99 and ev["preemptions_in_window"] == 12


def test_a_full_cache_that_costs_nothing_is_not_pressure():
    # a busy engine should fill its cache: no preemptions and nobody kept waiting
    trace = [obs(100 + 10 * i, cache_usage=0.99, preemptions=7, waiting=0) for i in range(30)]
    assert all(not a.acts for a in run(trace))
    # requests kept out for pressure_wait_seconds are pressure
    kept_out = [
        obs(100 + 10 * i, cache_usage=0.99, preemptions=7, waiting=2, running=6, oldest_waiting_s=8.0) for i in range(3)
    ]
    a = decide(kept_out, READY, CFG, 120)
    assert a.kind == "recycle" and a.reason == "high_cache"


def test_a_single_spike_does_not_act_even_with_both_conditions():
    spike = obs(100, cache_usage=1.0, waiting=50, running=1, oldest_waiting_s=100.0, preemptions=50)
    assert not decide([obs(90, preemptions=0), spike], READY, CFG, 100).acts


def test_events_outside_the_window_do_not_count():
    hot = dict(cache_usage=0.99, waiting=1, oldest_waiting_s=10.0)
    trace = [obs(100, **hot), obs(200, **hot), obs(450), obs(460, **hot)]
    assert not decide(trace, READY, CFG, 460).acts  # the first event is 360 s old
    assert decide(trace[:2] + [obs(210, **hot)], READY, CFG, 210).kind == "recycle"


def test_backlog_is_requests_that_age_and_empty_queues_do_not_count():
    trace = [obs(100 + i, waiting=9, running=4, oldest_waiting_s=31.0 + i) for i in range(3)]
    a = decide(trace, READY, CFG, 102)
    assert a.kind == "drain_restart" and a.reason == "backlog" and a.evidence["oldest_waiting_s"] == 33.0
    young = [obs(100 + i, waiting=9, running=4, oldest_waiting_s=0.2) for i in range(30)]
    assert all(not a.acts for a in run(young))  # a queue that is served within a step is no backlog
    idle = [obs(100 + i, waiting=0, running=0, oldest_waiting_s=0.0, cache_usage=0.0) for i in range(10)]
    assert not decide(idle, READY, CFG, 109).acts  # 0 > 2 x 0 is not a backlog


def test_a_queue_that_grows_while_its_oldest_request_waits_is_a_backlog():
    trace = [obs(100 + 10 * i, waiting=5 + 4 * i, running=2, oldest_waiting_s=12.0 + 10 * i) for i in range(3)]
    a = decide(trace, READY, CFG, 120)
    assert a.kind == "drain_restart" and a.reason == "backlog" and a.evidence["growing_queue"] is True
    # growing, but every poll sees fresh requests only (the old ones were served): not a backlog
    churn = [obs(100 + 10 * i, waiting=5 + 4 * i, running=2, oldest_waiting_s=0.5) for i in range(3)]
    assert not decide(churn, READY, CFG, 120).acts


def test_the_measured_scrape_race_never_acts():
    """The issue's measurement: under healthy steady load ~7 % of scrapes read waiting=8, running=0,
    cache 0.0 (the queue read between a batch finishing and the next step).  At a 1 s poll that is 21
    events per 300 s window; the old ratio rule restarted a healthy engine within the first minute."""
    import random

    rng = random.Random(7)
    trace = []
    for i in range(1800):  # 30 minutes at a 1 s poll
        t = 100.0 + i
        if rng.random() < 0.07:
            trace.append(obs(t, waiting=8, running=0, cache_usage=0.0, oldest_waiting_s=0.004, preemptions=0))
        else:
            trace.append(obs(t, waiting=0, running=8, cache_usage=0.31, oldest_waiting_s=0.0, preemptions=0))
    state = READY
    acted = [a for a in run(trace, state) if a.acts]
    races = sum(1 for o in trace if o.waiting == 8)
    print(f"race samples: {races} of {len(trace)}; policy actions: {len(acted)}")
    assert races > 100 and not acted


def test_true_backlog_and_true_pressure_traces_fire():
    # an overloaded engine at a 1 s poll: the queue grows 2 per second and nobody leaves it
    backlog = [
        obs(100.0 + i, waiting=10 + 2 * i, running=8, cache_usage=0.6, oldest_waiting_s=3.0 + i) for i in range(60)
    ]
    fired = next(a for a in run(backlog) if a.acts)
    assert fired.reason == "backlog"
    # a saturated cache that preempts every second
    pressure = [
        obs(100.0 + i, cache_usage=0.99, running=30, waiting=1, oldest_waiting_s=1.0, preemptions=3 * i)
        for i in range(60)
    ]
    fired = next(a for a in run(pressure) if a.acts)
    assert fired.reason == "high_cache" and fired.evidence["pressure_events"] == 3


def test_hang_by_health_waits_for_hang_seconds_and_skips_the_drain():
    trace = [
        obs(100),
        obs(110, health="timeout"),
        obs(120, health="timeout"),
        obs(130, health="stalled"),
        obs(140, health="timeout"),
    ]
    actions = run(trace)
    # the clock runs from the last good answer (t=100): no answer for 30 s at t=130
    assert [a.kind for a in actions] == ["none"] * 3 + ["restart"] * 2
    assert actions[3].reason == "hang" and actions[3].evidence["for_s"] == 30


def test_hang_by_frozen_steps_while_requests_wait():
    trace = [obs(100 + 10 * i, steps_total=500, waiting=1, running=2) for i in range(4)]
    assert decide(trace[:3], READY, CFG, 120).kind == "none"  # frozen for 20 s only
    a = decide(trace, READY, CFG, 130)
    assert a.kind == "restart" and a.reason == "hang" and a.evidence["steps_total"] == 500
    idle = [obs(100 + 10 * i, steps_total=500, waiting=0, running=0, cache_usage=0.0) for i in range(10)]
    assert not decide(idle, READY, CFG, 190).acts  # an idle engine may keep its step count


def test_a_brief_outage_is_not_a_hang():
    trace = [
        obs(100, health="timeout"),
        obs(110, health="timeout"),
        obs(120),
        obs(130, health="timeout"),
        obs(140, health="timeout"),
        obs(150),
    ]
    assert all(not a.acts for a in run(trace))


def test_nothing_but_exits_and_hangs_during_start_and_cooldown():
    starting = PolicyState(started_at=100.0)
    trace = [obs(100 + 10 * i, health="unreachable", cache_usage=None) for i in range(8)]
    assert [a.reason for a in run(trace, starting)] == ["starting"] * 8
    cooling = PolicyState(started_at=0.0, ready_at=95.0)
    hot = [obs(100 + 10 * i, cache_usage=0.99, waiting=10, running=1, oldest_waiting_s=99.0) for i in range(5)]
    assert all(a.reason == "cooldown" for a in run(hot, cooling))
    dead = hot + [obs(150, process_alive=False)]
    assert decide(dead, cooling, CFG, 150).reason == "engine_exited"


def test_hang_detection_is_not_delayed_by_the_cooldown_once_the_engine_served():
    # ready at 95, cooldown 60 s: a hang from t=100 is restarted at t=130 (hang_seconds), not after 155
    cooling = PolicyState(started_at=0.0, ready_at=95.0)
    trace = [obs(100)] + [obs(100 + 5 * i, health="timeout") for i in range(1, 8)]
    actions = run(trace, cooling)
    first = next(i for i, a in enumerate(actions) if a.acts)
    assert actions[first].reason == "hang" and trace[first].t == 130


def test_a_permanent_failure_gives_up_at_once():
    dead = [obs(100, process_alive=False, health="unreachable", exit_permanent=True)]
    a = decide(dead, PolicyState(started_at=90.0), CFG, 100)
    assert a.kind == "give_up" and a.reason == "permanent_failure"


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
    trace = [obs(100, process_alive=False), obs(110, cache_usage=1.0, waiting=99, running=0, oldest_waiting_s=60)]
    assert all(not a.acts for a in run(trace, gave_up))


def test_fragmentation_waits_for_the_window_and_for_low_traffic():
    trace = [obs(100 + 60 * i, allocator_efficiency=0.6, running=8, waiting=0) for i in range(12)]
    actions = run(trace)
    assert all(not a.acts for a in actions)
    assert actions[-1].reason == "fragmentation_waiting_for_low_traffic"
    quiet = trace + [obs(800, allocator_efficiency=0.6, running=1, waiting=0)]
    a = decide(quiet, READY, CFG, 800)
    assert a.kind == "recycle" and a.reason == "fragmentation" and a.evidence["for_s"] == 700
    recovered = trace[:-1] + [obs(760, allocator_efficiency=0.8, running=0)]
    assert not decide(recovered, READY, CFG, 760).acts


def test_actions_carry_what_the_supervisor_does_with_them():
    """The supervisor reads drains / counts_as_crash / permanent, never the reason string."""
    hang = decide([obs(100, health="stalled"), obs(140, health="stalled")], READY, CFG, 140)
    assert hang.reason == "hang" and hang.drains and hang.counts_as_crash and hang.drain_cap_s == 10.0
    dead = decide([obs(100, process_alive=False)], READY, CFG, 100)
    assert dead.reason == "engine_exited" and dead.counts_as_crash and not dead.drains
    failed = decide([obs(100, process_alive=False, exit_permanent=True)], READY, CFG, 100)
    assert failed.kind == "give_up" and failed.permanent
    hot = dict(cache_usage=0.99, waiting=3, running=1, oldest_waiting_s=40)
    pressure = decide([obs(100 + 10 * i, **hot) for i in range(3)], READY, CFG, 120)
    assert pressure.kind == "recycle" and not pressure.drains and not pressure.counts_as_crash
    assert not pressure.permanent and pressure.drain_cap_s is None
    recycled = PolicyState(started_at=0.0, ready_at=10.0, recycled_at=90.0)
    persists = decide([obs(100 + 10 * i, **hot) for i in range(3)], recycled, CFG, 120)
    assert persists.kind == "drain_restart" and persists.drains and not persists.counts_as_crash


def test_blocks_held_with_nothing_running_or_waiting_are_a_leak_cured_in_place():
    """KV usage above zero while no request runs or waits can only be blocks nobody owns: recycle the pool."""
    idle_leak = [obs(100 + 10 * i, cache_usage=0.3, running=0, waiting=0) for i in range(3)]
    actions = run(idle_leak)
    assert [a.kind for a in actions] == ["none", "none", "recycle"]
    assert actions[-1].reason == "stuck_cache" and actions[-1].evidence["polls"] == 3
    assert not actions[-1].drains and not actions[-1].counts_as_crash
    # the same usage with requests in flight is those requests' blocks, and an empty pool is healthy
    assert not any(a.acts for a in run([obs(100 + 10 * i, cache_usage=0.3, running=1, waiting=0) for i in range(9)]))
    assert not any(a.acts for a in run([obs(100 + 10 * i, cache_usage=0.0, running=0, waiting=0) for i in range(9)]))
    # one poll with a request between them breaks the run: three consecutive polls are needed
    broken = idle_leak[:2] + [obs(120, cache_usage=0.3, running=1, waiting=0)] + idle_leak[:2]
    assert not any(a.acts for a in run([replace(o, t=100 + 10 * i) for i, o in enumerate(broken)]))


def test_a_cure_that_did_not_hold_escalates_to_a_restart_within_the_window_only():
    leak = [obs(400 + 10 * i, cache_usage=0.3, running=0, waiting=0) for i in range(3)]
    soon = PolicyState(started_at=0.0, ready_at=10.0, recycled_at=350.0)
    a = decide(leak, soon, CFG, 420)
    assert a.kind == "drain_restart" and a.reason == "stuck_cache_persists" and a.drains
    assert a.evidence["recycled_s_ago"] == 70.0
    long_ago = PolicyState(started_at=0.0, ready_at=10.0, recycled_at=420.0 - CFG.event_window - 1)
    assert decide(leak, long_ago, CFG, 420).kind == "recycle"  # a new leak, long after the last cure
