"""The tuner policy: pure decisions over the observation history, no I/O.

Each poll the supervisor appends an `Observation`; `decide` reads the history since the last
restart, the restart log and the clock, and returns one `Action` with the rule that fired and the
evidence for it.  Being pure, every rule is tested with synthetic traces (tests/opsctl/test_policy.py).

The rules, in priority order:

| rule              | fires when                                                            | action        |
|-------------------|-----------------------------------------------------------------------|---------------|
| gave_up           | a crash loop or a permanent failure was seen earlier                  | none          |
| permanent_failure | the engine exited with code 2 (a mistake a person must fix)           | give_up       |
| engine_exited     | the engine process is gone (also during cooldown: a crash is a crash) | restart       |
| crash_loop        | a restart is due but max_restarts happened within restart_window      | give_up       |
| starting          | not yet ready, within ready_timeout                                   | none          |
| start_timeout     | not ready ready_timeout after the (re)start                           | restart       |
| hang              | health "stalled", or unreachable while the process lives, or steps    | restart       |
|                   | not advancing while requests wait, continuously for hang_seconds;     | (no drain)    |
|                   | checked as soon as the engine has served, cooldown or not             |               |
| cooldown          | ready < cooldown_seconds ago (holds back the rules below only)        | none          |
| stuck_cache       | KV blocks held with no request running or waiting, at events_to_act   | recycle       |
|                   | consecutive polls: blocks that nothing owns (a leak)                  |               |
| high_cache        | events_to_act pressure events within event_window: cache usage above  | recycle       |
|                   | the threshold *with* preemptions since the last poll or a request     |               |
|                   | waiting >= pressure_wait_seconds (it cannot be admitted)              |               |
| backlog           | events_to_act backlog events within event_window: waiting > factor x  | drain_restart |
|                   | running with the oldest waiting >= backlog_wait_seconds; or a queue   |               |
|                   | that grew at each of the last events_to_act polls while its oldest    |               |
|                   | request waited through all of them                                    |               |
| fragmentation     | allocator efficiency < threshold for fragmentation_window, and        | recycle       |
|                   | traffic is low (running + waiting <= low_traffic_requests)            |               |
| *_persists        | a rule whose cure is a recycle fires again within event_window of a   | drain_restart |
|                   | recycle: the cheap cure did not hold, so the process is replaced      |               |

The cheapest cure first: a recycle rebuilds the engine's KV pool and prefix cache in place (the running requests are
requeued and recomputed, none is lost, nothing stops serving: engine/core/engine_core.py), so a pool that stays
full in a healthy process costs milliseconds, not a restart.  A process restart stays the cure for hangs, crashes
and what a recycle did not cure.

Why the event rules look at age and preemptions, not at one instant's ratio: `waiting > 2 x running`
also holds for a healthy engine whenever a scrape lands between a burst's arrival and the step that
schedules it (measured: about 7 % of samples under steady load read waiting=8, running=0).  A request
that is merely between steps has waited milliseconds; a backlog is requests that age.  Likewise a full
cache is what a busy engine should have; it is pressure only when it preempts or keeps requests out.
The engine exports running, waiting, cache usage, the oldest waiting age and preemptions from one
snapshot taken after a step, so a poll reads them consistently.

A single bad poll never acts: the event rules need events_to_act events, and the hang and
fragmentation rules need a condition to hold for a duration.  Every action carries its evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Sequence

from pydantic import Field  # range metadata on the thresholds only; the policy itself does no I/O

Seconds = Annotated[float, Field(gt=0, le=7 * 86400)]
Fraction = Annotated[float, Field(gt=0, le=1)]


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds of every rule (defaults from the seed sidecar); the [supervisor] section sets them.

    The annotations carry each key's range: the config file is validated against them (opsctl/config.py).
    """

    cache_usage_threshold: Fraction = 0.95
    backlog_factor: Annotated[float, Field(gt=0)] = 2.0
    events_to_act: Annotated[int, Field(ge=1, le=1000)] = 3
    event_window: Seconds = 300.0
    hang_seconds: Seconds = 60.0
    fragmentation_threshold: Fraction = 0.7
    fragmentation_window: Seconds = 1800.0
    low_traffic_requests: Annotated[int, Field(ge=0)] = 2
    max_restarts: Annotated[int, Field(ge=1, le=1000)] = 5
    restart_window: Seconds = 900.0
    cooldown_seconds: Annotated[float, Field(ge=0, le=86400)] = 120.0
    ready_timeout: Seconds = 600.0
    backlog_wait_seconds: Annotated[float, Field(ge=0, le=86400)] = 30.0
    pressure_wait_seconds: Annotated[float, Field(ge=0, le=86400)] = 5.0


@dataclass(frozen=True)
class Observation:
    """One poll's view of the engine.  Missing readings are None, never guessed."""

    t: float
    process_alive: bool
    health: str  # ok | draining | stalled | unreachable | timeout | error
    cache_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    steps_total: float | None = None
    allocator_efficiency: float | None = None
    oldest_waiting_s: float | None = None
    preemptions: float | None = None  # the engine's counter (total so far)
    metrics_error: str | None = None
    exit_permanent: bool = False  # the process is gone with an exit code that says "do not retry"

    @property
    def answered(self) -> bool:
        return self.health in ("ok", "draining", "stalled")


@dataclass(frozen=True)
class Action:
    """One decision.  `reason` is the label (logs, metrics, status); what the supervisor does with the
    action is in the other fields, so that it never has to match on reason strings."""

    kind: str  # none | recycle | restart | drain_restart | give_up
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)
    drains: bool = False  # hand over: the old engine finishes its in-flight requests before it leaves
    counts_as_crash: bool = False  # the restart counts towards the crash-loop guard (max_restarts)
    permanent: bool = False  # give_up only: a person must fix something (exit code 2); never retried
    drain_cap_s: float | None = None  # sequential handover only: bound the drain, the successor needs the GPU

    @property
    def acts(self) -> bool:
        return self.kind != "none"


@dataclass(frozen=True)
class Effect:
    """What an acting rule's action does, besides its kind: one row per reason (see the table above)."""

    kind: str
    drains: bool = False
    counts_as_crash: bool = False
    permanent: bool = False
    drain_cap_s: float | None = None


# Every acting reason the policy can decide, and its effect.  A hung engine is drained (it may resume and
# finish its work) but briefly when one engine runs at a time: it holds the memory its successor needs.
EFFECTS: dict[str, Effect] = {
    "engine_exited": Effect("restart", counts_as_crash=True),
    "hang": Effect("restart", drains=True, counts_as_crash=True, drain_cap_s=10.0),
    "start_timeout": Effect("restart", counts_as_crash=True),
    "stuck_cache": Effect("recycle"),
    "high_cache": Effect("recycle"),
    "fragmentation": Effect("recycle"),
    "stuck_cache_persists": Effect("drain_restart", drains=True),
    "high_cache_persists": Effect("drain_restart", drains=True),
    "fragmentation_persists": Effect("drain_restart", drains=True),
    "backlog": Effect("drain_restart", drains=True),
    "crash_loop": Effect("give_up"),
    "permanent_failure": Effect("give_up", permanent=True),
}


def act(reason: str, evidence: dict[str, Any]) -> Action:
    """The acting action for `reason`, with the effect EFFECTS gives it."""
    e = EFFECTS[reason]
    return Action(
        e.kind,
        reason,
        evidence,
        drains=e.drains,
        counts_as_crash=e.counts_as_crash,
        permanent=e.permanent,
        drain_cap_s=e.drain_cap_s,
    )


NOTHING = Action("none", "healthy")


@dataclass(frozen=True)
class PolicyState:
    """What the supervisor remembers between decisions besides observations."""

    started_at: float  # the last (re)start of the engine
    ready_at: float | None = None  # when it first answered /health after that start
    restarts: tuple[float, ...] = ()  # timestamps of restarts the supervisor made
    gave_up: bool = False
    recycled_at: float | None = None  # the last in-place recycle of this engine's KV pool (the history restarts then)


def decide(history: Sequence[Observation], state: PolicyState, cfg: PolicyConfig, now: float) -> Action:
    """The one action for this poll; `history` holds observations since the last (re)start."""
    if state.gave_up:
        return Action("none", "gave_up", {"restarts": len(state.restarts)})
    if not history:
        return NOTHING
    last = history[-1]

    if not last.process_alive and last.exit_permanent:
        return act("permanent_failure", {"health": last.health})
    wanted = _wanted(history, state, cfg, now, last)
    if not wanted.acts:
        return wanted
    recent = [t for t in state.restarts if now - t <= cfg.restart_window]
    if len(recent) >= cfg.max_restarts:
        return act(
            "crash_loop",
            {
                "restarts_in_window": len(recent),
                "restart_window_s": cfg.restart_window,
                "max_restarts": cfg.max_restarts,
                "wanted": wanted.reason,
                **wanted.evidence,
            },
        )
    return wanted


def _wanted(
    history: Sequence[Observation], state: PolicyState, cfg: PolicyConfig, now: float, last: Observation
) -> Action:
    if not last.process_alive:
        return act("engine_exited", {"health": last.health})
    if state.ready_at is None:
        waited = now - state.started_at
        if waited >= cfg.ready_timeout:
            return act("start_timeout", {"waited_s": round(waited, 1), "health": last.health})
        return Action("none", "starting", {"waited_s": round(waited, 1)})
    hang = _hang(history, cfg, now)
    if hang.acts:
        return hang
    if now - state.ready_at < cfg.cooldown_seconds:
        return Action("none", "cooldown", {"seconds_left": round(cfg.cooldown_seconds - (now - state.ready_at), 1)})
    note = NOTHING  # a rule that holds back (e.g. waiting for low traffic) says so in the status
    for rule in (_stuck_cache, _events, _fragmentation):
        action = rule(history, cfg, now)
        if action.acts:
            return _escalated(action, state, cfg, now)
        if action is not NOTHING and note is NOTHING:
            note = action
    return note


def _escalated(action: Action, state: PolicyState, cfg: PolicyConfig, now: float) -> Action:
    """A recycle that fires again within event_window of the last one did not cure: restart instead."""
    if action.kind != "recycle" or state.recycled_at is None or now - state.recycled_at > cfg.event_window:
        return action
    return act(f"{action.reason}_persists", {**action.evidence, "recycled_s_ago": round(now - state.recycled_at, 1)})


def _stuck_cache(history: Sequence[Observation], cfg: PolicyConfig, now: float) -> Action:
    """KV blocks in use while no request runs or waits, at each of the last events_to_act polls: a leak."""
    tail = list(history[-cfg.events_to_act :])
    if len(tail) < cfg.events_to_act:
        return NOTHING

    def stuck(o: Observation) -> bool:
        return (o.cache_usage or 0.0) > 0.0 and o.running == 0 and o.waiting == 0

    if not all(stuck(o) for o in tail):
        return NOTHING
    return act(
        "stuck_cache",
        {
            "cache_usage": tail[-1].cache_usage,
            "polls": len(tail),
            "for_s": round(tail[-1].t - tail[0].t, 1),
        },
    )


def _held_since(history: Sequence[Observation], predicate: Callable[[Observation], bool]) -> float | None:
    """Start time of the trailing run of observations for which `predicate` holds (None if the last fails)."""
    since = None
    for obs in reversed(history):
        if not predicate(obs):
            break
        since = obs.t
    return since


def _hang(history: Sequence[Observation], cfg: PolicyConfig, now: float) -> Action:
    last = history[-1]

    def not_answering(o: Observation) -> bool:
        return o.process_alive and (o.health == "stalled" or not o.answered)

    first_silent = _held_since(history, not_answering)
    if first_silent is not None:
        # Unresponsive since its last good answer (the first silent probe was sent after that).
        i = next(i for i, o in enumerate(history) if o.t == first_silent)
        since = history[i - 1].t if i > 0 else first_silent
        if now - since >= cfg.hang_seconds:
            return act("hang", {"health": last.health, "for_s": round(now - since, 1)})

    # Steps frozen while requests wait: the metrics say the loop does not advance.
    if last.steps_total is not None and (last.waiting or 0) + (last.running or 0) > 0:
        frozen = [o for o in history if o.steps_total is not None and now - o.t <= cfg.hang_seconds + 1e-9]
        span = now - frozen[0].t if frozen else 0.0
        if (
            span >= cfg.hang_seconds
            and all(o.steps_total == last.steps_total for o in frozen)
            and all((o.waiting or 0) + (o.running or 0) > 0 for o in frozen)
        ):
            return act(
                "hang",
                {
                    "steps_total": last.steps_total,
                    "waiting": last.waiting,
                    "running": last.running,
                    "for_s": round(span, 1),
                },
            )
    return NOTHING


def _aged(o: Observation, seconds: float) -> bool:
    return o.oldest_waiting_s is not None and o.oldest_waiting_s >= seconds


def _over_ratio(o: Observation, cfg: PolicyConfig) -> bool:
    return (
        o.waiting is not None and o.running is not None and o.waiting > 0 and o.waiting > cfg.backlog_factor * o.running
    )


def _pressure(o: Observation, before: Observation | None, cfg: PolicyConfig) -> bool:
    """Cache usage above the threshold while it costs something: preemptions, or requests kept out."""
    if o.cache_usage is None or o.cache_usage <= cfg.cache_usage_threshold:
        return False
    preempted = (
        o.preemptions is not None
        and before is not None
        and before.preemptions is not None
        and o.preemptions > before.preemptions
    )
    kept_out = (o.waiting or 0) > 0 and _aged(o, cfg.pressure_wait_seconds)
    return preempted or kept_out


def _growing_backlog(window: Sequence[Observation], cfg: PolicyConfig) -> bool:
    """The queue grew at each of the last events_to_act polls and its oldest request waited through them."""
    tail = list(window[-cfg.events_to_act :])
    if len(tail) < max(2, cfg.events_to_act):
        return False
    if not all(_over_ratio(o, cfg) for o in tail):
        return False
    grew = all((b.waiting or 0) > (a.waiting or 0) for a, b in zip(tail, tail[1:]))
    return grew and _aged(tail[-1], tail[-1].t - tail[0].t)


def _events(history: Sequence[Observation], cfg: PolicyConfig, now: float) -> Action:
    window = [o for o in history if now - o.t <= cfg.event_window]
    pressure = backlog = 0
    peak_usage = peak_age = 0.0
    preempted = None
    for i, o in enumerate(window):
        before = window[i - 1] if i > 0 else None
        if _pressure(o, before, cfg):
            pressure += 1
            peak_usage = max(peak_usage, o.cache_usage or 0.0)
        if _over_ratio(o, cfg) and _aged(o, cfg.backlog_wait_seconds):
            backlog += 1
        peak_age = max(peak_age, o.oldest_waiting_s or 0.0)
    counts = [o.preemptions for o in window if o.preemptions is not None]
    if counts:
        preempted = counts[-1] - counts[0]
    growing = _growing_backlog(window, cfg)
    if pressure < cfg.events_to_act and backlog < cfg.events_to_act and not growing:
        return NOTHING
    reason = "high_cache" if pressure >= cfg.events_to_act else "backlog"
    last = history[-1]
    return act(
        reason,
        {
            "pressure_events": pressure,
            "backlog_events": backlog,
            "growing_queue": growing,
            "window_s": cfg.event_window,
            "peak_cache_usage": peak_usage,
            "oldest_waiting_s": round(peak_age, 1),
            "preemptions_in_window": preempted,
            "waiting": last.waiting,
            "running": last.running,
        },
    )


def _fragmentation(history: Sequence[Observation], cfg: PolicyConfig, now: float) -> Action:
    def fragmented(o: Observation) -> bool:
        return o.allocator_efficiency is not None and o.allocator_efficiency < cfg.fragmentation_threshold

    since = _held_since(history, fragmented)
    if since is None or now - since < cfg.fragmentation_window:
        return NOTHING
    last = history[-1]
    load = (last.running or 0) + (last.waiting or 0)
    if load > cfg.low_traffic_requests:
        return Action("none", "fragmentation_waiting_for_low_traffic", {"load": load})
    return act(
        "fragmentation",
        {
            "allocator_efficiency": last.allocator_efficiency,
            "for_s": round(now - since, 1),
            "load": load,
        },
    )
