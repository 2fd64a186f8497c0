"""The front's record of every request its core is working on: enough to hand each one to the next core.

For each request: what was admitted (the validated request, its arrival) and, per sequence, the tokens the core
has produced so far and whether it has ended.  When a core dies, every request still running into
an Admit for the next core (its prompt plus what it produced: engine/core/admission.py), or gives it up once it
has been resumed `max_resumes` times (`pause`, then `admits` once the next core is ready) or has waited for a
new core longer than its limit (`expired`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.admission import ValidRequest
from engine.core.deltas import SeqDelta
from engine.loop.messages import Admit


@dataclass(eq=False)
class _Live:
    valid: ValidRequest
    arrival: float
    produced: dict[int, list[int]]
    done: set[int] = field(default_factory=set)
    resumes: int = 0
    paused_at: float | None = None  # when its core died, until its first token from the next core
    reason: str = ""


@dataclass(frozen=True)
class Resumed:
    """A request that got a token from the core it was handed to after `reason` ended the one before."""

    request_id: str
    reason: str
    seconds: float  # from the old core's end to that token


class InFlight:
    def __init__(self, max_resumes: int) -> None:
        self.max_resumes = max_resumes
        self._live: dict[str, _Live] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def request_ids(self) -> set[str]:
        return set(self._live)

    def admitted(self, request_id: str, valid: ValidRequest, arrival: float) -> None:
        self._live[request_id] = _Live(valid, arrival, {i: [] for i in range(valid.params.n)})

    def ended(self, seq_id: str) -> None:
        """The front ended a sequence (a stop string, an abort)."""
        request_id, _, index = seq_id.rpartition("#")
        live = self._live.get(request_id)
        if live is not None:
            self._end(request_id, live, int(index))

    def record(self, deltas: list[SeqDelta], now: float) -> list[Resumed]:
        """Take a step's deltas; the requests among them that were waiting for their first token since a resume."""
        resumed: list[Resumed] = []
        for d in deltas:
            live = self._live.get(d.parent_id)
            if live is None or d.index in live.done:
                continue
            if d.token_id is not None:
                live.produced[d.index].append(d.token_id)
                if live.paused_at is not None:
                    resumed.append(Resumed(d.parent_id, live.reason, now - live.paused_at))
                    live.paused_at = None
            if d.finish_reason is not None:
                self._end(d.parent_id, live, d.index)
        return resumed

    def pause(self, reason: str, now: float) -> list[str]:
        """Their core ended (`reason`): every running request waits for the next one, except those resumed
        `max_resumes` times already, which are given up (their ids are returned)."""
        given_up: list[str] = []
        for request_id, live in list(self._live.items()):
            if live.resumes >= self.max_resumes:
                del self._live[request_id]
                given_up.append(request_id)
                continue
            live.resumes += 1
            live.reason = reason
            if live.paused_at is None:
                live.paused_at = now
        return given_up

    def expired(self, now: float, limit_s: float) -> list[str]:
        """Requests that have waited for a new core longer than `limit_s` since theirs ended: given up (removed)."""
        gone = [
            rid for rid, live in self._live.items() if live.paused_at is not None and now - live.paused_at > limit_s
        ]
        for request_id in gone:
            del self._live[request_id]
        return gone

    def admits(self) -> list[Admit]:
        """What to tell a new core: every running request, with the tokens each sequence has produced."""
        admits: list[Admit] = []
        for request_id, live in self._live.items():
            running = {i: list(toks) for i, toks in live.produced.items() if i not in live.done}
            if not live.done and all(not toks for toks in running.values()):
                admits.append(Admit(request_id, live.valid, live.arrival))  # nothing produced: as it came
            else:
                admits.append(Admit(request_id, live.valid, live.arrival, running))
        return admits

    def _end(self, request_id: str, live: _Live, index: int) -> None:
        live.done.add(index)
        if len(live.done) == len(live.produced):
            del self._live[request_id]
