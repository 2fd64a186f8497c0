"""Async scheduling (--max-num-on-the-fly-batches 2: step k+1 is queued before step k's tokens are
read) changes when work happens, never what comes out: the same tokens, text, finish reasons and
logprobs as the synchronous loop, with stop strings and EOS seen one step late, n > 1 forks, seeds,
preemption, aborts and prefix caching, and every block returned."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams


def _engine(depth: int, **kw) -> LLM:
    return LLM(max_model_len=128, max_num_on_the_fly_batches=depth, device="cpu", **kw)


def _workload(vocab: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(11)
    prompts, params = [], []
    texts = [
        "Beautiful is",
        "Explicit is",
        "Simple is",
        "Now is better",
        "Errors should never",
        "Special cases",
        "In the face of",
        "There should be",
    ]
    for i, t in enumerate(texts):
        prompts.append(t)
        params.append(SamplingParams(temperature=0, max_tokens=20, stop=["than", "."] if i % 2 else []))
    for i in range(8):
        prompts.append({"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(rng.randrange(1, 40))]})
        params.append(
            SamplingParams(
                temperature=0.8,
                top_p=0.9,
                seed=100 + i,
                max_tokens=rng.randrange(1, 24),
                n=1 + i % 3,
                logprobs=2 if i % 2 else None,
                ignore_eos=True,
            )
        )
    return prompts, params


def _summary(outs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _logprobs(outs) -> list:
    """(token ids, values) of every logprob entry; values compared approximately, since a recomputed
    prompt (preemption) runs the same math in a different batch shape."""
    ids, values = [], []
    for o in outs:
        for c in o.outputs:
            for e in c.logprobs or []:
                ids.append(sorted(e))
                values.extend(e[t].logprob for t in sorted(e))
    return [ids, values]


def _all_free(llm: LLM) -> None:
    kv = llm.llm_engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.num_sequences() == 0
    assert not llm.llm_engine.core.has_unfinished()


@pytest.mark.parametrize("pressure", ["roomy", "preempting"])
def test_depth_two_equals_the_synchronous_loop(pressure):
    kw = {} if pressure == "roomy" else dict(kv_cache_memory_bytes=None)
    probe = _engine(1)
    vocab = probe.llm_engine.core.model_info.hf_config.vocab_size
    if pressure == "preempting":  # 12 blocks of 16 tokens: far fewer than the workload holds at once
        kw = dict(kv_cache_memory_bytes=12 * probe.llm_engine.core.kv_plan.bytes_per_block, block_size=16)
    prompts, params = _workload(vocab)
    sync, piped = _engine(1, **kw), _engine(2, **kw)
    assert piped.llm_engine.core.pipeline_depth == 2
    expected = sync.generate(prompts, params, use_tqdm=False)
    got = piped.generate(prompts, params, use_tqdm=False)
    assert _summary(got) == _summary(expected)
    (got_ids, got_values), (want_ids, want_values) = _logprobs(got), _logprobs(expected)
    assert got_ids == want_ids and got_values == pytest.approx(want_values, abs=1e-4)
    if pressure == "preempting":
        assert piped.llm_engine.core.scheduler.num_preemptions > 0
    _all_free(sync)
    _all_free(piped)


def test_a_stop_string_seen_late_drops_the_extra_token():
    llm = _engine(2)
    out = llm.generate(["Beautiful is"], SamplingParams(temperature=0, max_tokens=30, stop=["than"]), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "than"
    assert out.text == " better "
    # the token after the stop string was computed in the overlapped step but never appended
    assert llm.llm_engine.tokenizer.decode(out.token_ids).strip().endswith("than")
    _all_free(llm)


def test_aborts_between_steps_return_every_block():
    llm = _engine(2)
    engine = llm.llm_engine
    for i in range(6):
        engine.add_request(
            str(i),
            {"prompt_token_ids": [5 + i] * (10 + i)},
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        )
    finals = {}
    for step in range(12):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if step == 4:  # a step is in flight for these: its tokens must be dropped, its blocks freed
            for rid in ("1", "3", "5"):
                finals[rid] = engine.abort_request(rid)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert sorted(finals) == [str(i) for i in range(6)]
    for rid, out in finals.items():
        c = out.outputs[0]
        if rid in ("1", "3", "5"):
            assert c.finish_reason == "abort" and len(c.token_ids) < 40
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 40
    _all_free(llm)


def test_the_next_step_is_queued_before_the_tokens_of_this_one_are_read():
    llm = _engine(2)
    engine = llm.llm_engine
    core = engine.core
    for i in range(4):
        engine.add_request(
            str(i),
            {"prompt_token_ids": [7 + i] * (5 + i)},
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        )
    engine.step()  # the prompts are queued; nothing has been read yet
    assert core._in_flight is not None and not any(r.output_token_ids for r in core.scheduler.running)
    for _ in range(5):
        engine.step()
        in_flight = core._in_flight
        assert in_flight is not None
        for req in map(
            core.scheduler.requests.get, in_flight.plan.sampled_ids()
        ):  # each holds exactly one unread token, counted in num_tokens
            assert req.num_pending == 1
            assert req.num_tokens == req.num_known_tokens + 1
            assert req.num_computed_tokens == req.num_tokens - 1
    while engine.has_unfinished_requests():
        engine.step()
    _all_free(llm)


def test_an_eos_seen_late_drops_the_token_computed_after_it():
    sync = _engine(1)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    free_run = sync.generate(["Beautiful is"], params, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = free_run[5]
    cut = free_run.index(stop_id) + 1
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True)
    piped = _engine(2)
    for llm in (sync, piped):
        out = llm.generate(["Beautiful is"], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free_run[:cut] and out.finish_reason == "stop" and out.stop_reason == stop_id
        _all_free(llm)


def test_blocks_of_generated_tokens_join_the_prefix_cache_once_read():
    """The decode step queued before its input token is known registers that block later, at accept:
    a follow-up prompt that repeats the first request's output hits the same blocks either way."""
    hits = {}
    for depth in (1, 2):
        llm = _engine(depth, enable_prefix_caching=True, block_size=8)
        first = llm.generate(
            {"prompt_token_ids": list(range(10, 30))},
            SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
            use_tqdm=False,
        )[0]
        follow_up = first.prompt_token_ids + first.outputs[0].token_ids + [3, 4, 5]
        kv = llm.llm_engine.core.kv
        before = kv.prefix_hits
        llm.generate({"prompt_token_ids": follow_up}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        hits[depth] = kv.prefix_hits - before
        _all_free(llm)
    # 20 + 37 tokens, of which 56 have KV: 7 full blocks of 8 tokens
    assert hits[1] == hits[2] == 56


def test_the_default_depth_follows_the_device():
    """Left out, the depth is 1 on the CPU (the host computes each step: a queued step only delays tokens) and 2 on
    a GPU; a value given is kept (capped at 2) on either."""
    from engine.config import EngineConfig

    assert EngineConfig().pipeline_depth("cpu") == 1
    assert EngineConfig().pipeline_depth("cuda") == 2
    assert EngineConfig(max_num_on_the_fly_batches=2).pipeline_depth("cpu") == 2
    assert EngineConfig(max_num_on_the_fly_batches=5).pipeline_depth("cuda") == 2
    assert EngineConfig(max_num_on_the_fly_batches=1).pipeline_depth("cuda") == 1
    assert LLM(max_model_len=128, device="cpu").llm_engine.core.pipeline_depth == 1
