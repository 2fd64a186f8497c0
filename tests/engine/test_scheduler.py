"""Scheduler behaviour on hand-made sequences: budgets, ordering, chunking, preemption."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.plan import SamplerOutput
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams


def _req(order: int, prompt_len: int, max_tokens: int = 8) -> Request:
    prompt = list(range(prompt_len))
    return Request(
        seq_id=f"r{order}",
        parent_id=f"r{order}",
        index=0,
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=max_tokens),
        max_tokens=max_tokens,
        arrival_order=order,
    )


@dataclass
class _Scheduled:
    request: Request
    num_tokens: int
    samples: bool


@dataclass
class _Step:
    seqs: list[_Scheduled]
    preempted: list[Request]
    num_batched_tokens: int


def _run_step(sched: Scheduler) -> _Step:
    """Schedule, pretend the model ran (token 0 for every sequence that samples), and accept."""
    known = dict(sched.requests)
    plan = sched.schedule()
    step = _Step(
        [_Scheduled(known[s.seq_id], s.num_tokens, bool(s.sample_ids)) for s in plan.seqs],
        [known[sid] for sid in plan.preempted],
        plan.num_batched_tokens,
    )
    sampled = plan.sampled_ids()
    sched.update(plan, SamplerOutput([0] * len(sampled), None, None))
    return step


def test_decodes_are_scheduled_before_prefills_and_budgets_hold():
    sched = Scheduler(KVCacheManager(100, 16), max_num_seqs=3, max_num_batched_tokens=20, enable_chunked_prefill=True)
    a, b = _req(0, 10), _req(1, 10)
    sched.add(a)
    sched.add(b)
    out = _run_step(sched)
    assert [(s.request, s.num_tokens) for s in out.seqs] == [(a, 10), (b, 10)]
    c, d = _req(2, 30), _req(3, 5)
    sched.add(c)
    sched.add(d)
    out = _run_step(sched)
    # Two decodes first (1 token each), then c gets the remaining 18 tokens as a chunk; the
    # 3-sequence cap leaves d waiting.
    assert [(s.request, s.num_tokens) for s in out.seqs] == [(a, 1), (b, 1), (c, 18)]
    assert out.num_batched_tokens == 20
    assert not out.seqs[2].samples
    assert d.status == RequestStatus.WAITING
    out = _run_step(sched)
    assert [(s.request, s.num_tokens) for s in out.seqs] == [(a, 1), (b, 1), (c, 12)]
    assert out.seqs[2].samples


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    sched = Scheduler(KVCacheManager(100, 16), max_num_seqs=8, max_num_batched_tokens=32, enable_chunked_prefill=False)
    a, b = _req(0, 20), _req(1, 20)
    sched.add(a)
    sched.add(b)
    out = _run_step(sched)
    assert [s.request for s in out.seqs] == [a]  # b does not fit the remaining 12 tokens
    out = _run_step(sched)
    assert [(s.request, s.num_tokens) for s in out.seqs] == [(a, 1), (b, 20)]


def test_preemption_takes_the_latest_arrival_and_it_comes_back_first():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True)
    a, b = _req(0, 8, max_tokens=20), _req(1, 8, max_tokens=20)
    sched.add(a)
    sched.add(b)
    _run_step(sched)  # both prefilled: 2 blocks each, pool full
    assert kv.num_free_blocks == 0
    out = _run_step(sched)  # a needs a third block for its 9th token: b (latest) is preempted
    assert out.preempted == [b]
    assert [s.request for s in out.seqs] == [a]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert kv.block_table("r1") == [] and sched.num_preemptions == 1
    late = _req(2, 2)
    sched.add(late)
    assert sched.waiting == [b, late]  # the preempted request is ahead of newer arrivals


def test_a_request_preempts_itself_when_it_is_the_latest():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True)
    a, b = _req(0, 8, max_tokens=20), _req(1, 4, max_tokens=20)
    sched.add(a)
    sched.add(b)
    _run_step(sched)
    for _ in range(3):
        _run_step(sched)  # b: 4 prompt tokens + decodes; a needs a third block on its first decode
    assert b.status == RequestStatus.WAITING
    assert a.status == RequestStatus.RUNNING


def test_finish_returns_blocks_from_either_queue():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64, enable_chunked_prefill=True)
    a, b = _req(0, 8), _req(1, 8)
    sched.add(a)
    sched.add(b)
    _run_step(sched)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 8 and not sched.has_unfinished()
