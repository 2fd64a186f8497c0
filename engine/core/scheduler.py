"""Iteration-level continuous batching under a sequence budget and a token budget.

Every step the scheduler decides, from scratch, which sequences run and how many of their tokens
get KV computed.  A sequence is just "tokens so far" and "tokens with KV so far", so prefill,
chunked prefill, decode, prefix-cache hits and recompute-after-preemption are the same operation
with different counts.

Order of service: running sequences (oldest first, so the oldest always makes progress), then
swapped-out ones (they come back before anything new), then waiting ones in arrival order.  When
the KV pool runs dry, the latest-arrived running sequence is preempted: swapped to CPU blocks
(`--preemption-mode swap`, while swap space lasts) or dropped to be recomputed later, so a
sequence that fits in the pool on its own can never fail.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from engine.core.request import Request, RequestStatus
from engine.kv.kv_cache_manager import KVCacheManager, KVOps


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
    ops: KVOps = field(default_factory=KVOps)  # block copies/swaps to run before the forward

    @property
    def empty(self) -> bool:
        return not self.seqs and not self.ops


def _order(req: Request) -> int:
    return req.arrival_order


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
        preemption_mode: str = "recompute",
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.waiting: list[Request] = []  # sorted by arrival
        self.running: list[Request] = []  # sorted by arrival
        self.swapped: list[Request] = []  # sorted by arrival
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------------------------

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=_order)

    def oldest_waiting_seconds(self, now: float | None = None) -> float:
        """How long the longest-waiting request (waiting or swapped out) has been in the engine."""
        heads = [q[0].arrival_time for q in (self.waiting, self.swapped) if q]
        if not heads:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - min(heads))

    def add_running(self, req: Request) -> None:
        """A forked sibling joins the running batch with the blocks it shares."""
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=_order)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take a sequence out of the queues for good and return its blocks."""
        if req.held_by is not None:
            req.held_by.forks.remove(req)
            req.held_by = None
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self.kv.free(req.seq_id)
        req.status = status
        req.finished_time = time.monotonic()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    # -- the step decision --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            # Admitting work in a step that had to preempt would only thrash the pool, and nothing
            # new is admitted while swapped sequences wait to come back.
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        out.ops = self.kv.take_ops()
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
            if n <= 0 or (req.num_pending and req.reaches_max_tokens):
                i += 1  # its last token is still on the device and ends it by length: nothing to compute
                continue
            while not self.kv.allocate_slots(req.seq_id, req.num_computed_tokens + n, req.num_computed_tokens):
                victim = self.running[-1]  # latest arrival; never one already scheduled this step
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return budget
            self._take(out, req, n)
            budget -= n
            i += 1
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(out.seqs) < self.max_num_seqs:
            req = self.swapped[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.can_swap_in(req.seq_id, req.num_computed_tokens + n):
                break
            self.kv.swap_in(req.seq_id)
            ok = self.kv.allocate_slots(req.seq_id, req.num_computed_tokens + n, req.num_computed_tokens)
            assert ok
            self.swapped.pop(0)
            self.add_running(req)
            self._take(out, req, n)
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(out.seqs) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:  # preempted while its step ran: it returns once that token is read
                return
            tokens = req.token_ids(0, req.num_tokens)
            cached = self.kv.cached_prefix(tokens)
            start = len(cached) * self.kv.block_size
            n = req.num_tokens - start
            if n > budget:
                if not self.chunked_prefill:
                    return
                n = budget
            if not self.kv.can_admit(cached, start + n):
                return
            self.kv.admit(req.seq_id, tokens, cached, start + n)
            req.num_computed_tokens = start
            self.waiting.pop(0)
            self.add_running(req)
            self._take(out, req, n)
            budget -= n

    def _take(self, out: SchedulerOutput, req: Request, n: int) -> None:
        out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
        out.num_batched_tokens += n

    def _preempt(self, req: Request) -> None:
        """Swap the sequence's blocks to CPU if configured and possible, else drop them for recompute."""
        self.running.remove(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.preemption_mode == "swap" and self.kv.can_swap_out(req.seq_id):
            self.kv.swap_out(req.seq_id)
            req.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, req, key=_order)
            return
        self.kv.free(req.seq_id)
        req.num_computed_tokens = 0
        self.add(req)

    # -- after the step -----------------------------------------------------------------------

    def record_progress(self, out: SchedulerOutput) -> None:
        """The step is queued on the device: its tokens count as having KV from now on, since every
        later step runs after it in stream order.  Full blocks join the prefix cache once their token
        ids are known (a pending token's block is registered when `cache_known_blocks` sees it)."""
        for s in out.seqs:
            req = s.request
            if req.status != RequestStatus.RUNNING:  # finished or preempted while the step ran
                continue
            req.num_computed_tokens = s.start + s.num_tokens
            self.cache_known_blocks(req)

    def cache_known_blocks(self, req: Request) -> None:
        if self.kv.prefix_caching and req.status == RequestStatus.RUNNING:
            self.kv.cache_full_blocks(req.seq_id, req.token_ids, min(req.num_computed_tokens, req.num_known_tokens))
