"""Start-up work done after the engine starts serving: CUDA graph capture and kernel warm-ups, a piece at a time.

A restart is a gap in service until the new engine serves.  Capturing the CUDA graphs (3-4 s for an 8B model, 20 s for a
70B one at TP=4) and warming kernels make steps faster but are not needed to serve: an eager step gives the same tokens.
So the server starts eagerly and runs this work in small units between steps (the engine core decides when:
engine/core/engine_core.py).  Decode graphs come first and each is replayed as soon as it is captured, the batch size
the steps need now before the others: an eager decode step takes several times a replayed one
(docs/decisions/deferred-startup-work.md).  The offline API (`LLM`) runs it all before it returns, as before.

Units run on the step loop's thread, inside `ModelRunner.launch` of the plan that asks for them, so that every
tensor-parallel rank runs the same unit at the same point (a capture runs the collectives inside the graph).  A
job that writes the KV cache (the mixed-step warm-up) says `needs_idle`: the core runs it only while no request
holds a block.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import structlog

log = structlog.get_logger("pagekeeper.engine")

SLOW_UNIT_S = 0.5  # a unit that held the step loop longer is logged


@dataclass
class Job:
    name: str
    units: Iterator[None]  # each next() runs one unit; exhausted when the job is done
    needs_idle: bool = False
    on_done: Callable[[], None] | None = None
    ready: Callable[[], bool] | None = None  # None: always; else the core waits until it says True
    # Its units make the steps under load faster at once (decode graphs): the core does not hold them back for
    # the first seconds of load as it does the rest.
    speeds_up_steps: bool = False
    seconds: float = 0.0
    count: int = 0


class DeferredWork:
    def __init__(self) -> None:
        self._jobs: deque[Job] = deque()
        self.seconds = 0.0  # spent so far
        self.done: dict[str, float] = {}  # job name -> seconds it took
        self.last_unit_seconds = 0.0  # how long the latest unit held the step loop (the core paces the next by it)

    def add(
        self,
        name: str,
        units: Iterator[None],
        needs_idle: bool = False,
        on_done: Callable[[], None] | None = None,
        ready: Callable[[], bool] | None = None,
        speeds_up_steps: bool = False,
    ) -> None:
        self._jobs.append(Job(name, units, needs_idle, on_done, ready, speeds_up_steps))

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    @property
    def next_ready(self) -> bool:
        """The next job may run now (a capture waits for host allocations that must not overlap it)."""
        return bool(self._jobs) and (self._jobs[0].ready is None or self._jobs[0].ready())

    @property
    def next_needs_idle(self) -> bool:
        return bool(self._jobs) and self._jobs[0].needs_idle

    @property
    def next_speeds_up_steps(self) -> bool:
        return bool(self._jobs) and self._jobs[0].speeds_up_steps

    def run_one(self) -> str | None:
        """Run the next unit; the name of its job, or None when nothing is left."""
        if not self._jobs:
            return None
        job = self._jobs[0]
        started = time.monotonic()
        try:
            next(job.units)
            finished = False
        except StopIteration:
            finished = True
        spent = time.monotonic() - started
        if spent > SLOW_UNIT_S:  # a unit holds the step loop: which one, when a restart's first steps wait on it
            log.info("deferred_unit_slow", job=job.name, unit=job.count, seconds=round(spent, 3))
        self.last_unit_seconds = spent
        job.seconds += spent
        job.count += 1
        self.seconds += spent
        if finished:
            self._jobs.popleft()
            if job.on_done is not None:
                job.on_done()
            self.done[job.name] = round(job.seconds, 3)
            log.info("deferred_job_done", job=job.name, units=job.count - 1, seconds=round(job.seconds, 3))
            if not self._jobs:
                log.info("deferred_work_done", jobs=self.done, seconds=round(self.seconds, 3))
        return job.name

    def run_all(self) -> float:
        """Run everything now (the offline API, tests); the seconds it took."""
        started = time.monotonic()
        while self.run_one() is not None:
            pass
        return time.monotonic() - started


def one_unit(fn: Callable[[], object]) -> Iterator[None]:
    """A job of a single unit."""
    fn()
    yield
