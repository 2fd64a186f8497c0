"""Steps with prompt tokens run as the model's forward in pieces split at the attentions, padded to a bucket of
token counts (engine/runner/piecewise.py).  On CUDA each piece is a graph; the split, the fixed buffers and the
padding are the same without graphs, so these tests run them on the CPU (`use_pieces_eagerly`) against the
plain forward: same tokens, same logprobs, same prompt logprobs, on a workload of mixed steps (decodes batched
with prompt chunks), chunked prompts, n > 1, seeds and prefix-cache hits, with steps past the largest bucket
falling back to the plain forward."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.plan import NewSeq, SamplingSpec, SeqStep, StepPlan
from engine.runner.model_runner import ModelRunner
from engine.runner.piecewise import (
    MAX_GRAPH_TOKENS,
    PiecewiseForward,
    candidate_buckets,
    cheapest_buckets,
    fused_rows,
    supports_pieces,
    token_buckets,
)
from tests.checkpoints import make_checkpoint


def test_token_buckets_cover_every_count_up_to_the_cap_with_bounded_padding():
    buckets = token_buckets(8192)
    assert buckets[-1] == MAX_GRAPH_TOKENS and buckets == sorted(set(buckets))
    assert token_buckets(100)[-1] == 100 and all(b <= 100 for b in token_buckets(100))
    assert token_buckets(1) == [1]
    for n in range(1, MAX_GRAPH_TOKENS + 1):
        padded = next(b for b in buckets if b >= n)
        assert padded - n < 32 or (padded - n) / n <= 0.25, (n, padded)
    print(f"\n{len(buckets)} buckets: {buckets}")


def _workload(vocab: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(11)
    shared = [rng.randrange(4, vocab) for _ in range(40)]  # a prefix some prompts share (prefix-cache hits)
    prompts, params = [], []
    for i in range(14):
        head = shared if i % 4 == 0 else []
        body = [rng.randrange(4, vocab) for _ in range(rng.choice([1, 3, 17, 45, 90, 150]))]
        prompts.append({"prompt_token_ids": head + body})
        params.append(
            SamplingParams(
                temperature=0 if i % 3 == 0 else 0.8,
                seed=100 + i,
                max_tokens=rng.randrange(3, 20),
                n=1 + i % 2,
                logprobs=2 if i % 2 else None,
                prompt_logprobs=1 if i % 5 == 0 else None,
                ignore_eos=True,
            )
        )
    return prompts, params


def _summary(outs) -> list:
    rows = []
    for o in outs:
        prompt = [None if e is None else sorted(e) for e in (o.prompt_logprobs or [])]
        rows.append(
            (prompt, [(c.token_ids, c.finish_reason, [sorted(e) for e in (c.logprobs or [])]) for c in o.outputs])
        )
    return rows


def test_the_cheapest_buckets_drop_every_count_a_larger_one_beats():
    # the H100's measured shape (benchmarks/results/overlap-probe-h100-gemm-2026-11-26.json): 448 dearer than 512
    costs = {288: 8.5, 320: 7.9, 352: 8.9, 384: 9.2, 416: 11.4, 448: 14.8, 480: 11.6, 512: 11.5, 544: 13.7}
    kept = cheapest_buckets(costs)
    print("kept", kept)
    assert kept == [320, 352, 384, 416, 512, 544]
    # a step pads to the smallest kept count that holds it, which is the cheapest candidate that holds it
    for tokens in range(257, 545):
        pad = min(k for k in kept if k >= tokens)
        assert costs[pad] == min(c for n, c in costs.items() if n >= tokens)
    assert cheapest_buckets({512: 1.0}) == [512]
    assert cheapest_buckets({300: 2.0, 400: 1.0}) == [400]  # the largest is always kept


def test_candidate_buckets_are_the_multiples_of_32_up_to_the_cap():
    assert candidate_buckets(100) == [32, 64, 96, 100]
    assert candidate_buckets(8192)[-1] == MAX_GRAPH_TOKENS and len(candidate_buckets(8192)) == MAX_GRAPH_TOKENS // 32
    assert candidate_buckets(1) == [1]


def test_fused_rows_finds_the_qkv_projection_behind_its_views():
    """One copy serves q, k and v when they are consecutive views of the fused projection's rows; q/k norms (Qwen3)
    give tensors of their own, which need one copy each."""
    t, hq, hk, d = 5, 4, 2, 8
    qkv = torch.randn(t, (hq + 2 * hk) * d)
    q, k, v = (x.reshape(t, -1, d) for x in qkv.split((hq * d, hk * d, hk * d), dim=-1))
    assert fused_rows(q, k, v) is not None and torch.equal(fused_rows(q, k, v), qkv)
    assert fused_rows(q.clone(), k, v) is None  # a normed q
    assert fused_rows(q, v, k) is None  # out of order
    one = qkv[:1]
    q1, k1, v1 = (x.reshape(1, -1, d) for x in one.split((hq * d, hk * d, hk * d), dim=-1))
    assert torch.equal(fused_rows(q1, k1, v1), one)


def test_mixed_steps_through_the_pieces_give_the_plain_forwards_outputs():
    engine_args = dict(max_model_len=256, device="cpu", max_num_seqs=8, max_num_batched_tokens=128)
    plain = LLM(**engine_args)
    pieced = LLM(**engine_args)
    runner = pieced.llm_engine.core.runner
    runner.use_pieces_eagerly(96)  # buckets 32, 64, 96: steps of 97..128 tokens take the plain forward
    assert runner.pieces is not None and runner.pieces.buckets == [32, 64, 96]
    steps: list[tuple[int, int | None]] = []
    prepare = runner.prepare

    def recording(plan):
        inputs = prepare(plan)
        steps.append((inputs.num_tokens, inputs.piece_rows))
        return inputs

    runner.prepare = recording
    vocab = plain.llm_engine.core.model_info.hf_config.vocab_size
    prompts, params = _workload(vocab)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = pieced.generate(prompts, params, use_tqdm=False)
    through_pieces = [(n, rows) for n, rows in steps if rows is not None]
    padded = [(n, rows) for n, rows in through_pieces if rows > n]
    plain_steps = [n for n, rows in steps if rows is None]
    print(
        f"\nsteps: {len(steps)}, through the pieces: {len(through_pieces)} ({len(padded)} padded), "
        f"plain: {len(plain_steps)} (decode-only or > 96 tokens)"
    )
    assert len(padded) >= 3 and any(n > 96 for n in plain_steps)
    assert all(rows in (32, 64, 96) and n <= rows for n, rows in through_pieces)
    assert _summary(got) == _summary(want)
    for g, w in zip(got, want):
        for cg, cw in zip(g.outputs, w.outputs):
            for eg, ew in zip(cg.logprobs or [], cw.logprobs or []):
                assert [eg[t].logprob for t in sorted(eg)] == pytest.approx(
                    [ew[t].logprob for t in sorted(ew)], abs=1e-4
                )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_pieces_over_padded_buffers_equal_the_plain_forward(tmp_path: Path, arch: str):
    """Model level, per architecture switch (Qwen2's q/k/v bias, Qwen3's q/k norm): the real rows' hidden states
    of a padded piecewise forward equal the plain forward's, and the padding row writes no KV."""
    llm = LLM(model=str(make_checkpoint(arch, tmp_path / arch)), device="cpu", max_model_len=128)
    model = llm.llm_engine.core.runner.model
    assert supports_pieces(model)
    greedy = SamplingSpec(temperature=0.0)
    plan = StepPlan(num_batched_tokens=31)
    for i, (n, blocks) in enumerate([(21, [0, 1]), (9, [2]), (1, [3])]):
        plan.new_seqs.append(NewSeq(f"s{i}", greedy))
        plan.seqs.append(
            SeqStep(f"s{i}", 0, n, list(range(5 + i, 5 + i + n)), table_blocks=blocks, sample_ids=[f"s{i}"])
        )
    runs = []
    for pieces in (False, True):
        runner = ModelRunner(model, 16, 16, torch.float32, torch.device("cpu"), 0, max_model_len=128)
        if pieces:
            runner.use_pieces_eagerly(64)
        runner.update_state(plan)
        runs.append((runner, runner.prepare(plan)))
    (plain_runner, plain_inputs), (piece_runner, piece_inputs) = runs
    assert plain_inputs.piece_rows is None and piece_inputs.piece_rows == 32 and piece_inputs.num_tokens == 31
    assert isinstance(piece_runner.pieces, PiecewiseForward)
    want = plain_runner.forward_hidden(plain_inputs)
    got = piece_runner.pieces.forward(32, 31, piece_inputs.meta)
    assert got.shape[0] == 32
    torch.testing.assert_close(got[:31], want, rtol=1e-5, atol=1e-5)
    for a, b in zip(plain_runner.kv_caches, piece_runner.kv_caches):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # the padding row (slot -1) wrote nothing


def test_a_model_without_the_split_runs_every_step_plainly(tmp_path: Path):
    llm = LLM(model=str(make_checkpoint("opt", tmp_path / "opt")), device="cpu", max_model_len=128)
    assert not supports_pieces(llm.llm_engine.core.runner.model)


def test_the_start_up_warm_up_of_mixed_steps_leaves_no_trace():
    """`warm_mixed_steps` (run at start-up on CUDA, so that the first mixed steps of serving compile no kernel)
    runs real steps on blocks no request holds yet: afterwards the runner holds no sequence, and an engine that ran
    it gives the same outputs as one that did not."""
    from engine.runner.startup import warm_mixed_steps

    engine_args = dict(max_model_len=256, device="cpu", max_num_seqs=8, max_num_batched_tokens=256)
    plain, warmed = LLM(**engine_args), LLM(**engine_args)
    core = warmed.llm_engine.core
    launched: list[int] = []
    launch = core.runner.launch

    def counting(plan, previous=None):
        launched.append(sum(s.num_tokens for s in plan.seqs))
        return launch(plan, previous)

    core.runner.launch = counting
    assert warm_mixed_steps(core.runner, core.config) == 2
    core.runner.launch = launch
    print(f"\nwarm-up steps: {launched} tokens")
    assert len(launched) == 2 and core.runner.num_sequences == 0
    vocab = plain.llm_engine.core.model_info.hf_config.vocab_size
    prompts, params = _workload(vocab)
    assert _summary(warmed.generate(prompts, params, use_tqdm=False)) == _summary(
        plain.generate(prompts, params, use_tqdm=False)
    )
