"""Fresh prompt chunks on the dense path (kernels/dense_prefill.py) inside a real engine step.

A mixed step holds a decode, a chunk after cached context and three fresh chunks (two of one length, one
longer), in a plan order that is none of the runner's groups.  The runner must list the decode first, the
paged chunk next and the fresh chunks last, shortest first, as two dense runs; and the step's logits, row by
row in the plan's order, must equal those of the same step with the dense path off (every chunk read back
from the paged cache).
"""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.core.plan import NewSeq, SamplingSpec, SeqStep, StepPlan
from kernels.dense_prefill import DenseRun


def _step(llm: LLM, plan: StepPlan):
    core = llm.llm_engine.core
    core.runner.update_state(plan)
    inputs = core.runner.prepare(plan)
    with torch.inference_mode():
        hidden = core.runner.forward_hidden(inputs)
        logits = core.model.compute_logits(hidden[inputs.logits_rows]).float()
    return inputs, logits


def test_a_mixed_step_runs_fresh_chunks_last_and_gives_the_paged_paths_logits():
    llm = LLM(max_model_len=128, block_size=8)
    engine, core = llm.llm_engine, llm.llm_engine.core
    vocab = int(core.model_info.hf_config.vocab_size)
    lengths = {"a": 7, "b": 7, "c": 12, "d": 14, "e": 10}
    prompts = {sid: [(31 * i + 7 * n) % vocab for i in range(n)] for n, sid in zip(lengths.values(), lengths)}
    sids = {}
    for sid, ids in prompts.items():
        (sids[sid],) = engine.add_request(f"req-{sid}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    try:
        for sid in ("d", "e"):
            assert core.kv.allocate_slots(sids[sid], lengths[sid])
        # Step 1: d's first 10 tokens and e's first 9, so that step 2 holds a chunk after context and a decode.
        first = StepPlan(
            [
                SeqStep(sids["d"], 0, 10, prompts["d"][:10], table_blocks=list(core.kv.block_table(sids["d"]))),
                SeqStep(sids["e"], 0, 9, prompts["e"][:9], table_blocks=list(core.kv.block_table(sids["e"]))),
            ],
            new_seqs=[NewSeq(sids[s], SamplingSpec()) for s in ("d", "e")],
        )
        _step(llm, first)
        for sid in ("a", "b", "c"):
            assert core.kv.allocate_slots(sids[sid], lengths[sid])

        def seq(sid: str, start: int, n: int) -> SeqStep:
            ids = prompts[sid][start : start + n]
            table = list(core.kv.block_table(sids[sid]))
            return SeqStep(sids[sid], start, n, ids, table_blocks=table, sample_ids=[sids[sid]])

        second = StepPlan(
            [seq("a", 0, 7), seq("d", 10, 4), seq("e", 9, 1), seq("c", 0, 12), seq("b", 0, 7)],
            new_seqs=[NewSeq(sids[s], SamplingSpec()) for s in ("a", "b", "c")],
        )
        inputs, dense_logits = _step(llm, second)
        dense = inputs.meta.dense
        assert dense is not None and inputs.meta.num_decodes == 1
        # rows: e 0, d 1-4, then a 5-11, b 12-18 (one run of two 7-token chunks), c 19-30
        assert dense.runs == (DenseRun(5, 2, 7), DenseRun(19, 1, 12))
        assert dense.num_seqs == 3 and dense.paged_max_query_len == 4
        assert inputs.meta.query_start_loc.tolist() == [0, 1, 5, 12, 19, 31]

        core.runner.dense_lengths = None  # the same step with every chunk read from the paged cache
        replay = StepPlan(second.seqs)
        inputs, paged_logits = _step(llm, replay)
        assert inputs.meta.dense is None
        err = float((dense_logits - paged_logits).abs().max() / paged_logits.abs().max())
        print(f"dense vs paged logits: max relative error {err:.2e} over {tuple(paged_logits.shape)}")
        assert err < 1e-5
    finally:
        for sid in prompts:
            engine.abort_request(f"req-{sid}")
        core.runner.update_state(StepPlan(finished=list(sids.values())))
