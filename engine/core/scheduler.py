"""Iteration-level continuous batching under a sequence budget and a token budget.

Every step the scheduler decides, from scratch, which sequences run and how many of their tokens
get KV computed.  A sequence is just "tokens so far" and "tokens with KV so far", so prefill,
chunked prefill, decode and recompute-after-preemption are the same operation with different
counts.  Running sequences go first (oldest first, so the oldest always makes progress), then
waiting ones in arrival order.  When the KV pool runs dry, the latest-arrived running sequence is
preempted: its blocks are freed and it goes back to the waiting queue to be recomputed later, so a
sequence that fits in the pool on its own can never fail.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from engine.core.request import Request, RequestStatus
from engine.kv.kv_cache_manager import KVCacheManager


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # tokens that already had KV before this step
    num_tokens: int  # tokens computed this step
    samples: bool = field(init=False)  # this step reaches the last token, so a new one is sampled

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.seqs


def _order(req: Request) -> int:
    return req.arrival_order


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = enable_chunked_prefill
        self.waiting: list[Request] = []  # sorted by arrival
        self.running: list[Request] = []  # sorted by arrival
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------------------------

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=_order)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take a sequence out of the queues for good and return its blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self.kv.free(req.seq_id)
        req.status = status
        req.finished_time = time.monotonic()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- the step decision --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            # Admitting new work in a step that had to preempt would only thrash the pool.
            self._schedule_waiting(out, budget)
        now = time.monotonic()
        for s in out.seqs:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0 and len(out.seqs) < self.max_num_seqs:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req.seq_id, req.num_computed_tokens + n):
                victim = self.running[-1]  # latest arrival; never one already scheduled this step
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return budget
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
            out.num_batched_tokens += n
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(out.seqs) < self.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens - req.num_computed_tokens
            if n > budget:
                if not self.chunked_prefill:
                    return
                n = budget
            if not self.kv.allocate_slots(req.seq_id, req.num_computed_tokens + n):
                return
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=_order)
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
            out.num_batched_tokens += n
            budget -= n

    def _preempt(self, req: Request) -> None:
        """Recompute-mode preemption: drop the sequence's KV; it re-enters the queue by arrival."""
        self.running.remove(req)
        self.kv.free(req.seq_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.add(req)

    # -- after the step -----------------------------------------------------------------------

    def record_progress(self, out: SchedulerOutput) -> None:
        """The step ran: the scheduled tokens now have KV."""
        for s in out.seqs:
            s.request.num_computed_tokens = s.start + s.num_tokens
