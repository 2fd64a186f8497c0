"""The tuner policy: pure decisions over the observation history, no I/O.

Each poll the supervisor appends an `Observation`; `decide` reads the history since the last
restart, the restart log and the clock, and returns one `Action` with the rule that fired and the
evidence for it.  Being pure, every rule is tested with synthetic traces (tests/opsctl/test_policy.py).

The rules, in priority order:

| rule            | fires when                                                              | action        |
|-----------------|-------------------------------------------------------------------------|---------------|
| gave_up         | a crash loop was detected earlier                                       | none          |
| engine_exited   | the engine process is gone (also during cooldown: a crash is a crash)   | restart       |
| crash_loop      | a restart is due but max_restarts happened within restart_window        | give_up       |
| cooldown        | not yet ready (within ready_timeout), or ready < cooldown_seconds ago   | none          |
| start_timeout   | not ready ready_timeout after the (re)start                             | restart       |
| hang            | health "stalled", or unreachable while the process lives, or steps not  | restart       |
|                 | advancing while requests wait, continuously for hang_seconds            | (no drain)    |
| high_cache /    | cache usage > threshold and waiting > factor x running each count as an | drain_restart |
| backlog         | event; events_to_act events within event_window                         |               |
| fragmentation   | allocator efficiency < threshold for fragmentation_window, and traffic  | drain_restart |
|                 | is low (running + waiting <= low_traffic_requests)                      |               |

A single bad poll never acts: the event rule needs events_to_act events (one poll gives at most
two), and the hang and fragmentation rules need a condition to hold for a duration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds of every rule (defaults from the seed sidecar); the [supervisor] section sets them."""

    cache_usage_threshold: float = 0.95
    backlog_factor: float = 2.0
    events_to_act: int = 3
    event_window: float = 300.0
    hang_seconds: float = 60.0
    fragmentation_threshold: float = 0.7
    fragmentation_window: float = 1800.0
    low_traffic_requests: int = 2
    max_restarts: int = 5
    restart_window: float = 900.0
    cooldown_seconds: float = 120.0
    ready_timeout: float = 600.0


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
    metrics_error: str | None = None

    @property
    def answered(self) -> bool:
        return self.health in ("ok", "draining", "stalled")


@dataclass(frozen=True)
class Action:
    kind: str  # none | restart | drain_restart | give_up
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def acts(self) -> bool:
        return self.kind != "none"


NOTHING = Action("none", "healthy")


@dataclass(frozen=True)
class PolicyState:
    """What the supervisor remembers between decisions besides observations."""

    started_at: float  # the last (re)start of the engine
    ready_at: float | None = None  # when it first answered /health after that start
    restarts: tuple[float, ...] = ()  # timestamps of restarts the supervisor made
    gave_up: bool = False


def decide(history: Sequence[Observation], state: PolicyState, cfg: PolicyConfig, now: float) -> Action:
    """The one action for this poll; `history` holds observations since the last (re)start."""
    if state.gave_up:
        return Action("none", "gave_up", {"restarts": len(state.restarts)})
    if not history:
        return NOTHING
    last = history[-1]

    wanted = _wanted(history, state, cfg, now, last)
    if not wanted.acts:
        return wanted
    recent = [t for t in state.restarts if now - t <= cfg.restart_window]
    if len(recent) >= cfg.max_restarts:
        return Action("give_up", "crash_loop", {
            "restarts_in_window": len(recent), "restart_window_s": cfg.restart_window,
            "max_restarts": cfg.max_restarts, "wanted": wanted.reason, **wanted.evidence,
        })
    return wanted


def _wanted(history: Sequence[Observation], state: PolicyState, cfg: PolicyConfig, now: float,
            last: Observation) -> Action:
    if not last.process_alive:
        return Action("restart", "engine_exited", {"health": last.health})
    if state.ready_at is None:
        waited = now - state.started_at
        if waited >= cfg.ready_timeout:
            return Action("restart", "start_timeout", {"waited_s": round(waited, 1), "health": last.health})
        return Action("none", "starting", {"waited_s": round(waited, 1)})
    if now - state.ready_at < cfg.cooldown_seconds:
        return Action("none", "cooldown", {"seconds_left": round(cfg.cooldown_seconds - (now - state.ready_at), 1)})
    note = NOTHING  # a rule that holds back (e.g. waiting for low traffic) says so in the status
    for rule in (_hang, _events, _fragmentation):
        action = rule(history, cfg, now)
        if action.acts:
            return action
        if action is not NOTHING and note is NOTHING:
            note = action
    return note


def _held_since(history: Sequence[Observation], predicate) -> float | None:  # type: ignore[no-untyped-def]
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
            return Action("restart", "hang", {"health": last.health, "for_s": round(now - since, 1)})

    # Steps frozen while requests wait: the metrics say the loop does not advance.
    if last.steps_total is not None and (last.waiting or 0) + (last.running or 0) > 0:
        frozen = [o for o in history if o.steps_total is not None and now - o.t <= cfg.hang_seconds + 1e-9]
        span = now - frozen[0].t if frozen else 0.0
        if span >= cfg.hang_seconds and all(o.steps_total == last.steps_total for o in frozen) and all(
            (o.waiting or 0) + (o.running or 0) > 0 for o in frozen
        ):
            return Action("restart", "hang", {"steps_total": last.steps_total, "waiting": last.waiting,
                                              "running": last.running, "for_s": round(span, 1)})
    return NOTHING


def _events(history: Sequence[Observation], cfg: PolicyConfig, now: float) -> Action:
    high = backlog = 0
    peak_usage = 0.0
    for o in history:
        if now - o.t > cfg.event_window:
            continue
        if o.cache_usage is not None and o.cache_usage > cfg.cache_usage_threshold:
            high += 1
            peak_usage = max(peak_usage, o.cache_usage)
        if o.waiting is not None and o.running is not None and o.waiting > 0 and \
                o.waiting > cfg.backlog_factor * o.running:
            backlog += 1
    if high + backlog >= cfg.events_to_act:
        reason = "high_cache" if high >= backlog else "backlog"
        last = history[-1]
        return Action("drain_restart", reason, {
            "high_cache_events": high, "backlog_events": backlog, "window_s": cfg.event_window,
            "peak_cache_usage": peak_usage, "waiting": last.waiting, "running": last.running,
        })
    return NOTHING


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
    return Action("drain_restart", "fragmentation", {
        "allocator_efficiency": last.allocator_efficiency, "for_s": round(now - since, 1), "load": load,
    })
