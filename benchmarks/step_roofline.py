"""A schedule-aware roofline: the engine's own steps, each at the device's ceiling.

The simple roofline (prefill FLOPs at the matmul rate plus decode bytes at copy bandwidth) treats
prefill and decode as if they ran one after the other.  A continuous-batching engine runs them in the
same steps: a step that prefills a chunk is compute-bound, and the decodes riding in it cost almost
nothing extra, while a step of a few long-tail decodes reads every weight for a handful of tokens.
So the bound that says what this schedule could reach replays the steps the scheduler really planned
(recorded from its plain-data StepPlans) and costs each at

    max(bytes it must move / copy bandwidth, FLOPs it must do / matmul rate)

with the weights read once per step.  The additive bound (the simple roofline, over the same steps:
prefill FLOPs at the matmul rate plus decode bytes at copy bandwidth) is reported beside it.  Neither
is below the other in general: a compute-bound mixed step costs less in the aware bound (the decodes
ride along), a bandwidth-bound prefill step more (its bytes count there, only its FLOPs in the other).
Both count a step's work exactly from its plan: each sequence's new tokens, the context it attends to,
and the rows it samples.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass(frozen=True)
class ModelCost:
    """The per-token costs of a decoder-only transformer of one shape and weight width."""

    linear_params: int  # every projection of every layer
    lm_head_params: int
    layers: int
    heads: int
    head_dim: int
    kv_bytes_per_token: int  # K and V of every layer
    weight_bytes: int  # what one step reads: the linears and the LM head (not the embedding)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], dtype_bytes: int) -> ModelCost:
        h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
        heads, kv_heads, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
        head_dim = cfg.get("head_dim") or h // heads
        linear = layers * (h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + 3 * h * inter)
        lm_head = h * vocab
        return cls(
            linear_params=linear,
            lm_head_params=lm_head,
            layers=layers,
            heads=heads,
            head_dim=head_dim,
            kv_bytes_per_token=2 * layers * kv_heads * head_dim * dtype_bytes,
            weight_bytes=(linear + lm_head) * dtype_bytes,
        )

    def attention_flops(self, start: int, num_tokens: int) -> float:
        """QK^T and PV of `num_tokens` queries at positions start.. over every earlier key (causal)."""
        keys_seen = num_tokens * start + num_tokens * (num_tokens + 1) / 2
        return self.layers * 4 * self.heads * self.head_dim * keys_seen


@dataclass(frozen=True)
class StepShape:
    """What a step computed: (start, num_tokens) per sequence, and how many rows it sampled."""

    seqs: tuple[tuple[int, int], ...]
    samples: int

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.seqs)


def step_work(step: StepShape, cost: ModelCost) -> dict[str, float]:
    """FLOPs and bytes of one step, split into its prefill part (sequences computing more than one
    token) and its decode part (one token each)."""
    prefill_flops = decode_flops = attention_flops = 0.0
    decode_kv = kv = 0.0
    has_decode = False
    for start, n in step.seqs:
        attention = cost.attention_flops(start, n)
        attention_flops += attention
        flops = 2 * cost.linear_params * n + attention
        touched = (start + n) * cost.kv_bytes_per_token  # the context read, the new tokens written
        kv += touched
        if n == 1:
            has_decode = True
            decode_flops += flops
            decode_kv += touched
        else:
            prefill_flops += flops
    head = 2 * cost.lm_head_params * step.samples
    return {
        "flops": prefill_flops + decode_flops + head,
        "bytes": cost.weight_bytes + kv,
        "attention_flops": attention_flops,
        "kv_bytes": kv,
        "prefill_flops": prefill_flops + (0.0 if has_decode else head),
        "decode_bytes": (cost.weight_bytes + decode_kv) if has_decode else 0.0,
    }


def layer_sequential_seconds(
    work: dict[str, float], cost: ModelCost, matmul_flops: float, copy_bytes_per_s: float
) -> float:
    """A step's time when its projections and its attention each run at their own ceiling, one after the other,
    as every layer does (the attention needs the projections' q/k/v, the next projection its output): the
    projections at max(weight bytes, their FLOPs), the attention at max(KV bytes, its FLOPs).  The schedule-aware
    bound takes the max over the whole step instead, as if the KV reads of the decodes could hide under the
    projections' FLOPs; in a step where both are large (many decodes batched with a prompt chunk) the two differ
    by up to 2x, so this one says how far the kernels are from their own limits."""
    linear_flops = work["flops"] - work["attention_flops"]
    projections = max(cost.weight_bytes / copy_bytes_per_s, linear_flops / matmul_flops)
    attention = max(work["kv_bytes"] / copy_bytes_per_s, work["attention_flops"] / matmul_flops)
    return projections + attention


def bounds(steps: list[StepShape], cost: ModelCost, matmul_flops: float, copy_bytes_per_s: float) -> dict[str, Any]:
    """Seconds this exact schedule needs at the device's ceilings: per step max(bytes, FLOPs) time
    (schedule-aware), and prefill FLOPs + decode bytes over the whole run (additive)."""
    aware = additive_prefill = additive_decode = sequential = 0.0
    compute_bound = 0
    for step in steps:
        w = step_work(step, cost)
        t_bytes, t_flops = w["bytes"] / copy_bytes_per_s, w["flops"] / matmul_flops
        aware += max(t_bytes, t_flops)
        sequential += layer_sequential_seconds(w, cost, matmul_flops, copy_bytes_per_s)
        compute_bound += t_flops > t_bytes
        additive_prefill += w["prefill_flops"] / matmul_flops
        additive_decode += w["decode_bytes"] / copy_bytes_per_s
    return {
        "steps": len(steps),
        "compute_bound_steps": compute_bound,
        "tokens_computed": sum(s.tokens for s in steps),
        "schedule_aware_s": aware,
        "additive_s": additive_prefill + additive_decode,
        "additive_prefill_s": additive_prefill,
        "additive_decode_s": additive_decode,
        "layer_sequential_s": sequential,
    }


class StepLog(list[StepShape]):
    """The steps of a run in order, with the perf_counter() time at which the scheduler planned each."""

    def __init__(self) -> None:
        super().__init__()
        self.planned_at: list[float] = []

    def seconds_by_kind(self, end: float) -> dict[str, dict[str, float]]:
        """Wall seconds between each step's plan and the next's (the last: until `end`), summed over the
        decode-only steps and over the steps that carry prompt tokens.  With the engine's pipelined steps a step's
        planning may precede the previous one's finish, so a kind's share is approximate by about one step."""
        out = {"decode": {"steps": 0, "seconds": 0.0}, "prefill": {"steps": 0, "seconds": 0.0}}
        ends = self.planned_at[1:] + [end]
        for step, start, stop in zip(self, self.planned_at, ends):
            kind = out["decode" if all(n == 1 for _, n in step.seqs) else "prefill"]
            kind["steps"] += 1
            kind["seconds"] += stop - start
        return out


@contextlib.contextmanager
def recorded_steps(llm: Any) -> Iterator[StepLog]:
    """Every step the engine's scheduler plans inside the block, as StepShapes (the plan is plain
    data, so reading it changes nothing the engine does), and when each was planned (`StepLog.planned_at`)."""
    scheduler = llm.llm_engine.core.scheduler
    steps = StepLog()
    original = scheduler.schedule

    def schedule() -> Any:
        plan = original()
        if plan.seqs:
            steps.planned_at.append(time.perf_counter())
            steps.append(
                StepShape(tuple((s.start, s.num_tokens) for s in plan.seqs), sum(len(s.sample_ids) for s in plan.seqs))
            )
        return plan

    scheduler.schedule = schedule
    try:
        yield steps
    finally:
        del scheduler.schedule  # the bound method again
