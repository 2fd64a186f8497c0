"""The engine's state as the supervisor reports it, its allowed transitions, and `opsctl`'s exit codes.

The state is derived, not stored: from what the supervisor is doing (an action in progress), whether it
gave up, whether the engine process lives, has served since its (re)start, and what /health said.  It is
derived in one place (`derive`) and every change is checked in one place (`StateTracker`), so that a
state `opsctl status` reports and the exit code automation reads from it can never disagree.

Why the transitions are permissive between the live states: the engine's health changes under the
supervisor at any time (it can die, stall or recover between two polls), so any live state may follow any
other.  What is not allowed says what the supervisor does: after giving up it only leaves by a restart
(`opsctl restart`), a restart ends in a live state, and stopping is the end.
"""

from __future__ import annotations

from enum import StrEnum

import structlog

log = structlog.get_logger("pagekeeper.supervisor")

# `opsctl` exit codes (see opsctl/cli.py's table).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_RUNNING = 3
EXIT_TRANSITION = 4
EXIT_DRAINING = 5
EXIT_GAVE_UP = 6
EXIT_UNSUPERVISED = 7
EXIT_UNHEALTHY = 8


class EngineState(StrEnum):
    """The `engine.state` of `opsctl status` (the values are the strings it shows and its JSON holds)."""

    STARTING = "starting"  # (re)started, has not served yet
    SERVING = "serving"
    DRAINING = "draining"  # a load balancer's drain (`opsctl drain`), or /health says so
    RESTARTING = "restarting"
    RECYCLING = "recycling"  # its KV pool is being rebuilt in place (it keeps serving)
    STOPPING = "stopping"
    EXITED = "exited"  # the process is gone; the policy restarts it (unless exit code 2)
    STALLED = "stalled"  # /health: work waits and the step loop does not advance
    UNRESPONSIVE = "unresponsive"  # no usable answer from /health
    GAVE_UP = "gave_up"  # the crash-loop guard
    FAILED = "failed"  # the engine exited 2: a person must fix something
    NOT_RUNNING = "not_running"  # no supervisor, no engine (opsctl only: no daemon reports it)
    UNSUPERVISED = "unsupervised"  # an engine serves without a supervisor (opsctl only)

    @property
    def exit_code(self) -> int:
        """`opsctl status`'s exit code in this state."""
        return _EXIT_CODES[self]

    @property
    def gave_up(self) -> bool:
        return self in (EngineState.GAVE_UP, EngineState.FAILED)


_EXIT_CODES = {
    EngineState.SERVING: EXIT_OK,
    EngineState.STARTING: EXIT_TRANSITION,
    EngineState.RESTARTING: EXIT_TRANSITION,
    EngineState.RECYCLING: EXIT_OK,
    EngineState.STOPPING: EXIT_TRANSITION,
    EngineState.DRAINING: EXIT_DRAINING,
    EngineState.GAVE_UP: EXIT_GAVE_UP,
    EngineState.FAILED: EXIT_GAVE_UP,
    EngineState.EXITED: EXIT_UNHEALTHY,
    EngineState.STALLED: EXIT_UNHEALTHY,
    EngineState.UNRESPONSIVE: EXIT_UNHEALTHY,
    EngineState.NOT_RUNNING: EXIT_NOT_RUNNING,
    EngineState.UNSUPERVISED: EXIT_UNSUPERVISED,
}

# The states a supervisor reports while the engine is up to the engine itself (health, process).
LIVE = frozenset(
    {
        EngineState.STARTING,
        EngineState.SERVING,
        EngineState.DRAINING,
        EngineState.EXITED,
        EngineState.STALLED,
        EngineState.UNRESPONSIVE,
    }
)
# Actions in progress (the supervisor's `busy`).
BUSY = frozenset({EngineState.DRAINING, EngineState.RESTARTING, EngineState.RECYCLING, EngineState.STOPPING})

TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    **{
        s: LIVE
        | {EngineState.RESTARTING, EngineState.RECYCLING, EngineState.STOPPING, EngineState.GAVE_UP}
        | {EngineState.FAILED}
        for s in LIVE
    },
    EngineState.RESTARTING: LIVE,
    EngineState.RECYCLING: LIVE | {EngineState.RESTARTING, EngineState.STOPPING},
    EngineState.GAVE_UP: frozenset({EngineState.RESTARTING}),
    EngineState.FAILED: frozenset({EngineState.RESTARTING}),
    EngineState.STOPPING: frozenset({EngineState.RESTARTING}),  # `opsctl retire`, then `opsctl restart`
    EngineState.NOT_RUNNING: frozenset(),
    EngineState.UNSUPERVISED: frozenset(),
}

_BY_HEALTH = {"ok": EngineState.SERVING, "draining": EngineState.DRAINING, "stalled": EngineState.STALLED}


def derive(
    *, gave_up: bool, permanent: bool, busy: EngineState | None, alive: bool, ready: bool, health: str
) -> EngineState:
    """The reported state; the order is the precedence (giving up outranks an action in progress, ...)."""
    if gave_up:
        return EngineState.FAILED if permanent else EngineState.GAVE_UP
    if busy is not None:
        return busy
    if not alive:
        return EngineState.EXITED
    if not ready:
        return EngineState.STARTING
    return _BY_HEALTH.get(health, EngineState.UNRESPONSIVE)


def allowed(old: EngineState | None, new: EngineState) -> bool:
    return old is None or old == new or new in TRANSITIONS[old]


class StateTracker:
    """The last reported state; logs each change, and warns about one the table does not allow."""

    def __init__(self) -> None:
        self.state: EngineState | None = None

    def update(self, new: EngineState) -> EngineState:
        old = self.state
        if old != new:
            if allowed(old, new):
                log.info("engine_state", state=new.value, previous=old.value if old else None)
            else:  # a bug in the supervisor, not in the engine: say so, and report what is true
                log.warning(
                    "engine_state_unexpected",
                    state=new.value,
                    previous=old.value if old else None,
                    allowed=sorted(s.value for s in TRANSITIONS[old]) if old else None,
                )
            self.state = new
        return new
