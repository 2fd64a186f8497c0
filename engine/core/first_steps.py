"""The first steps an engine serves, timed and logged once (`first_steps`).

After a restart or a crash the requests that waited arrive at once, and what they wait for next is the new
engine's first steps: eager steps before its CUDA graphs are captured, units of deferred start-up work between
them, kernels a shape meets for the first time.  Those seconds are the tail of the outage an operator sees, and
without this line nothing says where they went.  One line, once per server process, for its first `count` steps
with sequences in them: each step's kind, sequences, tokens, deferred units run before it and milliseconds from
its launch to its tokens read.
"""

from __future__ import annotations

import structlog

from engine.core.plan import StepPlan

log = structlog.get_logger("pagekeeper.engine")

FIRST_STEPS_LOGGED = 48


def step_kind(plan: StepPlan) -> str:
    """decode (one token per sequence), prefill (prompt chunks only) or mixed."""
    tokens = [s.num_tokens for s in plan.seqs]
    if all(n == 1 for n in tokens):
        return "decode"
    return "mixed" if any(n == 1 for n in tokens) else "prefill"


class FirstSteps:
    """Collects the first `count` steps with sequences, then logs them as one `first_steps` event."""

    def __init__(self, count: int = FIRST_STEPS_LOGGED) -> None:
        self.count = count
        self.steps: list[list[object]] = []
        self._slowest_ms = 0.0
        self._first_at = 0.0
        self.done = count <= 0

    def record(self, plan: StepPlan, launched_at: float, read_at: float) -> None:
        if self.done or not plan.seqs:
            return
        if not self.steps:
            self._first_at = launched_at
        ms = round((read_at - launched_at) * 1000, 1)
        self.steps.append([step_kind(plan), len(plan.seqs), plan.num_batched_tokens, plan.deferred_units, ms])
        self._slowest_ms = max(self._slowest_ms, ms)
        if len(self.steps) >= self.count:
            self.done = True
            log.info(
                "first_steps",
                fields=["kind", "seqs", "tokens", "deferred_units", "ms"],
                steps=self.steps,
                seconds=round(read_at - self._first_at, 3),
                slowest_ms=self._slowest_ms,
            )
            self.steps = []
