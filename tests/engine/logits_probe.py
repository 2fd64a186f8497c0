"""Teacher-forced logits through the engine's paged KV path, and greedy agreement between two engines:
what the quantization tests compare a quantized engine with its unquantized twin by."""

from __future__ import annotations

import json

import torch

from engine import LLM, SamplingParams
from engine.core.plan import NewSeq, SamplingSpec, SeqStep, StepPlan
from engine.default_model import DEFAULT_MODEL_DIR


def engine_logits(llm: LLM, ids: list[int], chunk: int) -> torch.Tensor:
    """float32 logits for every position of `ids`, fed `chunk` tokens per step (1: every token through
    the decode path, reading all earlier ones from the cache)."""
    engine = llm.llm_engine
    core = engine.core
    (sid,) = engine.add_request("logits-probe", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    rows = []
    try:
        for start in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - start)
            assert core.kv.allocate_slots(sid, start + n)
            plan = StepPlan(
                [SeqStep(sid, start, n, ids[start : start + n], table_blocks=list(core.kv.block_table(sid)))],
                new_seqs=[NewSeq(sid, SamplingSpec())] if start == 0 else [],
            )
            core.runner.update_state(plan)
            inputs = core.runner.prepare(plan)
            with torch.inference_mode():
                rows.append(core.model.compute_logits(core.runner.forward_hidden(inputs)).float())
    finally:
        engine.abort_request("logits-probe")
        core.runner.update_state(StepPlan(finished=[sid]))
    return torch.cat(rows)


def zen_text() -> str:
    """The embedded model's training text (the Zen of Python): what it predicts well, so a quantized
    copy's mistakes show as changed tokens rather than noise between near-ties."""
    zen = json.loads((DEFAULT_MODEL_DIR / "zen_prefixes.json").read_text())
    return "".join(z["prefix"] + z["completion"] + "\n" for z in zen)


def zen_prefixes() -> list[str]:
    return [z["prefix"] for z in json.loads((DEFAULT_MODEL_DIR / "zen_prefixes.json").read_text())]


def logit_error(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, float]:
    """max |difference| relative to the largest |logit|, mean |difference|, and how often the argmax agrees."""
    return {
        "max_rel": float((ours - theirs).abs().max() / theirs.abs().max()),
        "mean_abs": float((ours - theirs).abs().mean()),
        "argmax_agree": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()),
    }


def greedy(llm: LLM, prompts: list, max_tokens: int = 32) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    """(fraction of generated positions with the same token, number of identical sequences)."""
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    return same / sum(len(s) for s in a), sum(s == t for s, t in zip(a, b))
