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

import numpy as np

from engine.core.deltas import SeqDelta
from engine.core.plan import NewSeq, SamplerOutput, SeqStep, StepPlan
from engine.core.request import Request, RequestStatus
from engine.kv.kv_cache_manager import KVCacheManager


@dataclass(slots=True)
class _Chosen:
    """A sequence picked for this step, before the plan is written."""

    request: Request
    start: int  # tokens that already had KV before this step
    num_tokens: int  # tokens computed this step


@dataclass
class _Decision:
    chosen: list[_Chosen] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0


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
        eos_token_ids: frozenset[int] | set[int] = frozenset(),
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
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}  # every unfinished sequence, held siblings included
        self._forget: list[str] = []  # finished sequences the runner still has state for
        self.num_prompt_tokens_done = 0  # prompts of sequences that produced their first token
        self.num_constrained = 0  # unfinished sequences with a grammar (structured outputs)
        # {time the previous token was read: tokens read after it}, for every token after a sequence's
        # first; the engine core empties it after each step into its inter-token latency histogram.
        self.token_gaps: dict[float, int] = {}

    # -- queue management ---------------------------------------------------------------------

    def add(self, req: Request) -> None:
        """Queue a sequence (and the n > 1 siblings that wait for its prompt)."""
        for r in (req, *req.forks):
            self.requests[r.seq_id] = r
            self.num_constrained += r.grammar is not None
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
        if req.grammar is not None and not req.status.finished:
            self.num_constrained -= 1
        req.status = status
        req.finished_time = time.monotonic()
        self.requests.pop(req.seq_id, None)
        if req.known_to_runner:
            self._forget.append(req.seq_id)

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

    def schedule(self) -> StepPlan:
        """Decide the next step and write it down as a plan.

        The plan is final once returned: the runner will run it, and every later step runs after it
        on the device, so its progress is recorded here (positions count as having KV, the sampling
        rows' tokens count as pending until `update` reads them).
        """
        out = _Decision()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            # Admitting work in a step that had to preempt would only thrash the pool, and nothing
            # new is admitted while swapped sequences wait to come back.
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        ops = self.kv.take_ops()
        plan = StepPlan(
            finished=self._forget,
            preempted=[r.seq_id for r in out.preempted],
            swap_out=ops.swap_out,
            swap_in=ops.swap_in,
            copies=ops.copies,
            num_batched_tokens=out.num_batched_tokens,
        )
        self._forget = []
        now = time.monotonic()
        row = 0
        constrained: list[tuple[int, Request]] = []
        for c in out.chosen:
            req = c.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            step = self._seq_step(plan, c)
            plan.seqs.append(step)
            # Recorded now: finished or preempted sequences cannot be among the chosen.
            req.num_computed_tokens = c.start + c.num_tokens
            self.cache_known_blocks(req)
            if c.start + c.num_tokens < req.num_tokens:
                continue  # a prompt chunk that does not reach the end: nothing is sampled
            for sampler in [req, *req.forks]:
                if sampler.held_by is not None:
                    self._fork(sampler)
                self._register(plan, sampler)
                step.sample_ids.append(sampler.seq_id)
                if sampler.grammar is not None:
                    # its mask follows from every token before this one: none may still be on the device
                    assert sampler.num_pending == 0, "a constrained sequence was scheduled with a pending token"
                    constrained.append((row, sampler))
                sampler.num_pending += 1
                sampler.pending_row = row
                row += 1
        if constrained:
            self._write_masks(plan, constrained)
        return plan

    @staticmethod
    def _write_masks(plan: StepPlan, constrained: list[tuple[int, Request]]) -> None:
        first = constrained[0][1].grammar
        assert first is not None
        masks = np.empty((len(constrained), first.mask_words), dtype=np.int32)
        for i, (_, req) in enumerate(constrained):
            assert req.grammar is not None
            req.grammar.fill(masks[i])
        plan.mask_rows = [row for row, _ in constrained]
        plan.token_masks = masks

    def _seq_step(self, plan: StepPlan, c: _Chosen) -> SeqStep:
        req = c.request
        self._register(plan, req)
        end = c.start + c.num_tokens
        known = min(end, req.num_known_tokens)
        pending_row = -1
        if known < end:  # only the newest token can still be on the device
            assert end - known == 1, "a sequence has more than one token on the device"
            pending_row = req.pending_row
        table = self.kv.block_table(req.seq_id)
        sent = req.sent_table
        if len(sent) <= len(table) and table[: len(sent)] == sent:
            start, blocks = len(sent), table[len(sent) :]
            sent.extend(blocks)
        else:  # admitted again, swapped in, forked or copied on write: the whole table
            start, blocks = 0, list(table)
            req.sent_table = list(table)
        return SeqStep(req.seq_id, c.start, c.num_tokens, req.token_ids(c.start, known), pending_row, start, blocks)

    def _register(self, plan: StepPlan, req: Request) -> None:
        if not req.known_to_runner:
            req.known_to_runner = True
            wants = req.sampling.repetition_penalty != 1.0 or req.sampling.prompt_logprobs is not None
            prompt = req.prompt_token_ids if wants else None
            plan.new_seqs.append(NewSeq(req.seq_id, req.sampling, req.num_prompt_tokens, prompt))

    def _fork(self, req: Request) -> None:
        """The leader's prompt is done: the sibling shares its blocks and joins the batch."""
        leader = req.held_by
        assert leader is not None
        self.kv.fork(leader.seq_id, req.seq_id)
        req.num_computed_tokens = leader.num_computed_tokens
        req.first_scheduled_time = leader.first_scheduled_time
        leader.forks.remove(req)
        req.held_by = None
        self.add_running(req)

    def _schedule_running(self, out: _Decision, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0 and len(out.chosen) < self.max_num_seqs:
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

    def _schedule_swapped(self, out: _Decision, budget: int) -> int:
        while self.swapped and budget > 0 and len(out.chosen) < self.max_num_seqs:
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

    def _schedule_waiting(self, out: _Decision, budget: int) -> None:
        while self.waiting and budget > 0 and len(out.chosen) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:  # preempted while its step ran: it returns once that token is read
                return
            tokens = req.token_ids(0, req.num_tokens)
            # prompt logprobs come from computing the prompt: a cached prefix would skip its positions
            cached = self.kv.cached_prefix(tokens) if req.prompt_logprobs_done else []
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

    def _take(self, out: _Decision, req: Request, n: int) -> None:
        out.chosen.append(_Chosen(req, req.num_computed_tokens, n))
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
        self._requeue(req)

    def _requeue(self, req: Request) -> None:
        """Back to the waiting queue, to be recomputed (it stays in `requests`, counted once)."""
        self.kv.free(req.seq_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=_order)

    def preempt_all(self) -> int:
        """Every running sequence back to waiting, to be recomputed (the engine recycling its KV pool: no
        request is lost, each continues from the tokens it has); swapped ones keep their CPU blocks.  Returns
        how many were requeued.  Only between steps: no token may be on the device."""
        victims = list(self.running)
        for req in victims:
            assert req.num_pending == 0, "recycling with a token on the device"
            self.running.remove(req)
            req.num_preemptions += 1
            self.num_preemptions += 1
            self._requeue(req)
        return len(victims)

    # -- after the step -----------------------------------------------------------------------

    def update(self, plan: StepPlan, sampled: SamplerOutput, now: float | None = None) -> list[SeqDelta]:
        """Accept a step's sampled tokens: append them, end sequences by stop id, EOS or max_tokens,
        and register newly full blocks in the prefix cache.  A sequence that ended (or was aborted)
        while the step ran drops its token."""
        deltas: list[SeqDelta] = []
        cache = self.kv.prefix_caching
        for chunk in sampled.prompt_logprobs or ():
            holder = self.requests.get(chunk.seq_id)
            if holder is not None:
                holder.record_prompt_logprobs(chunk)
        t = time.monotonic() if now is None else now
        gaps = self.token_gaps
        for i, seq_id in enumerate(plan.sampled_ids()):
            req = self.requests.get(seq_id)
            if req is None:  # finished while the step ran
                continue
            req.num_pending -= 1
            if req.status.finished:
                continue
            token = sampled.token_ids[i]
            req.output_token_ids.append(token)
            delta = SeqDelta(seq_id, req.parent_id, req.index, token)
            wants = req.sampling.logprobs
            if wants is not None and sampled.logprobs is not None:
                delta.logprob = sampled.logprobs[i]
                top = sampled.top_logprobs[i] if sampled.top_logprobs is not None else {}
                delta.top_logprobs = dict(list(top.items())[:wants])
            if len(req.output_token_ids) == 1:
                if req.prompt_logprobs is not None:  # the sequence that computed the prompt: n > 1 shares it
                    delta.prompt_logprobs = req.prompt_logprobs
                self.num_prompt_tokens_done += req.num_prompt_tokens
                delta.first_scheduled_time = req.first_scheduled_time
                req.first_token_time = delta.first_token_time = t
            else:  # grouped by the previous token's time: a decode batch shares it
                gaps[req.last_token_time] = gaps.get(req.last_token_time, 0) + 1
            req.last_token_time = t
            p = req.params
            if req.grammar is not None:
                req.grammar.accept(token)
            if p.stop_token_ids and token in p.stop_token_ids:
                req.stop_reason = token
                self.finish(req, RequestStatus.FINISHED_STOPPED)
            elif not p.ignore_eos and token in self.eos_token_ids:
                self.finish(req, RequestStatus.FINISHED_STOPPED)
            elif req.grammar is not None and req.grammar.finished:  # complete (or refused): nothing may follow
                status = RequestStatus.FINISHED_ABORTED if req.grammar.rejected else RequestStatus.FINISHED_STOPPED
                self.finish(req, status)
            elif len(req.output_token_ids) >= req.max_tokens:
                self.finish(req, RequestStatus.FINISHED_LENGTH)
            if req.status.finished:
                delta.finish_reason = req.status.value
                delta.stop_reason = req.stop_reason
            elif cache:
                self.cache_known_blocks(req)
            deltas.append(delta)
        return deltas

    def cache_known_blocks(self, req: Request) -> None:
        if self.kv.prefix_caching and req.status == RequestStatus.RUNNING:
            self.kv.cache_full_blocks(req.seq_id, req.token_ids, min(req.num_computed_tokens, req.num_known_tokens))
