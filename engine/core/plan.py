"""The contract between the core and the runner: the plan in, the samples out, and the runner as the core sees it.

Both sides import this module and nothing else of each other (tests/test_layering.py): the core builds plans and
reads samples, the runner (engine/runner/, and every tensor-parallel rank) runs plans and returns samples, and the
core drives whichever runner its caller started through `StepRunner`.  Nothing here imports torch at run time, so
that a front whose core runs in another process (which imports the plan's types) needs none.

A step plan is plain data: what the scheduler decided, and all the runner needs to run it.
The plan holds no live objects (no requests, no tensors, no tokenizer): ids, counts, token ids,
block ids and sampling settings.  That makes it the one thing that crosses from the scheduler to
the runner, in-process today and to tensor-parallel worker processes later, and it lets the runner
keep its own persistent per-sequence state (block tables, random generators) updated from plans.

A sequence's block table travels as a change: `table_start` and `table_blocks` say "keep the first
`table_start` blocks you have and append these", so a decode step sends at most one new block id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

    from engine.config import ResolvedConfig
    from engine.memory.budget import KVPlan
    from engine.model.interface import CausalLM
    from engine.model.loader import ModelInfo


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """How a sequence's next tokens are drawn (SamplingParams minus what only the host needs)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    logprobs: int | None = None  # top-k logprobs wanted (0: only the chosen token's); None: none
    seed: int | None = None  # a sequence with a seed draws output token k's numbers from (seed, seed_offset + k)
    seed_offset: int = 0  # output tokens produced before this sequence was admitted (a resumed request)
    # vLLM's logits adjustments (engine/runner/logits_adjust.py applies them on the device)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0  # until this many tokens are out, `min_tokens_stop_ids` cannot be sampled
    min_tokens_stop_ids: tuple[int, ...] = ()  # EOS (unless ignore_eos) and stop_token_ids
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    allowed_token_ids: tuple[int, ...] | None = None  # every other token is masked
    prompt_logprobs: int | None = None  # top-k logprobs of every prompt position (0: the prompt token's only)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def biased(self) -> bool:
        return bool(self.logit_bias) or self.allowed_token_ids is not None


@dataclass(slots=True)
class NewSeq:
    """A sequence the runner has not seen yet: it creates its sampling state once."""

    seq_id: str
    sampling: SamplingSpec
    prompt_len: int = 0  # the sample after position p is output token number p + 1 - prompt_len
    # The prompt's ids, only when the repetition penalty (it also penalizes prompt tokens) or the
    # prompt logprobs (each position's logprob of the next prompt token) need them.
    prompt_token_ids: list[int] | None = None


@dataclass(slots=True)
class SeqStep:
    """One sequence's share of a step: positions [start, start + num_tokens) get KV computed."""

    seq_id: str
    start: int  # tokens that already had KV before this step
    num_tokens: int  # tokens computed this step
    # Ids of those positions the host knows.  One fewer than num_tokens when the last input is the
    # token that the step still on the device samples (async scheduling): the runner then takes it
    # from row `pending_row` of that step's samples, on the device.
    token_ids: list[int]
    pending_row: int = -1
    table_start: int = 0  # the runner keeps this many blocks of the table it has ...
    table_blocks: list[int] = field(default_factory=list)  # ... and appends these
    # Sequences that sample a token from this step's last position: empty while a prompt is still
    # being prefilled in chunks, [seq_id] normally, and the n > 1 siblings after it when the shared
    # prompt completes.
    sample_ids: list[str] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    seqs: list[SeqStep] = field(default_factory=list)
    new_seqs: list[NewSeq] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # sequences the runner may forget
    preempted: list[str] = field(default_factory=list)  # sequences this step pushed out (for the record)
    # Block movements to run before the forward, in this order: (gpu, cpu), (cpu, gpu), (src, dst).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Structured outputs: row i of `token_masks` ([len(mask_rows), ceil(vocab / 32)] int32; bit t of
    # word t // 32 set: token t allowed) constrains sample row `mask_rows[i]` of this step.
    mask_rows: list[int] = field(default_factory=list)
    token_masks: np.ndarray | None = None
    # Units of deferred start-up work (graph capture, warm-ups: engine/runner/deferred.py) every rank runs before
    # this step, so that tensor-parallel ranks run them at the same point.
    deferred_units: int = 0

    @property
    def has_block_ops(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copies)

    @property
    def empty(self) -> bool:
        """Nothing for the device to do (forgetting finished sequences needs no step)."""
        return not self.seqs and not self.has_block_ops

    def sampled_ids(self) -> list[str]:
        """The sequences that get a token from this step, in the order of the step's sample rows."""
        return [sid for s in self.seqs for sid in s.sample_ids]


# -- what the runner returns (engine/runner/sampler.py computes it) ----------------------------------------------


@dataclass
class PromptLogprobsChunk:
    """Logprobs of prompt tokens first_position, first_position + 1, ... of one sequence, as one
    step's (chunk of the) prefill computed them from the positions before each."""

    seq_id: str
    first_position: int
    logprobs: list[float]
    ranks: list[int]  # 1: the prompt token was the most likely
    top: list[dict[int, float]] | None  # the request's top-k at each position (None: k = 0)


@dataclass
class DevicePromptLogprobs:
    """A PromptLogprobsChunk while on the device."""

    seq_id: str
    first_position: int
    logprobs: torch.Tensor  # [m] float32
    ranks: torch.Tensor  # [m] int64
    top_ids: torch.Tensor | None  # [m, k]
    top_values: torch.Tensor | None

    def to_host(self) -> PromptLogprobsChunk:
        top = None
        if self.top_ids is not None and self.top_values is not None:
            top = [dict(zip(i, v)) for i, v in zip(self.top_ids.tolist(), self.top_values.tolist())]
        return PromptLogprobsChunk(self.seq_id, self.first_position, self.logprobs.tolist(), self.ranks.tolist(), top)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # of the chosen tokens
    top_logprobs: list[dict[int, float]] | None
    prompt_logprobs: list[PromptLogprobsChunk] | None = None


@dataclass
class DeviceSample:
    """A step's samples while they may still be computing: tensors on the device, not yet read.

    Reading them (`to_host`) waits for the device; the step loop does that as late as it can, so
    that the CPU work of the previous step overlaps this step's GPU work.
    """

    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor | None  # [S] float32
    top_ids: torch.Tensor | None  # [S, k]
    top_values: torch.Tensor | None  # [S, k]
    ready: torch.cuda.Event | None = None
    device_token_ids: torch.Tensor | None = None  # the tokens where they were computed: the next step's inputs
    prompt_logprobs: list[DevicePromptLogprobs] | None = None  # read with the tokens (small: one row each)

    @property
    def tokens_on_device(self) -> torch.Tensor:
        return self.token_ids if self.device_token_ids is None else self.device_token_ids

    def to_host(self) -> SamplerOutput:
        if self.ready is not None:
            self.ready.synchronize()
        top = None
        if self.top_ids is not None and self.top_values is not None:
            top = [dict(zip(i, v)) for i, v in zip(self.top_ids.tolist(), self.top_values.tolist())]
        lp = self.logprobs.tolist() if self.logprobs is not None else None
        prompt = [p.to_host() for p in self.prompt_logprobs] if self.prompt_logprobs else None
        return SamplerOutput(self.token_ids.tolist(), lp, top, prompt)


# -- the runner as the core drives it ------------------------------------------------------------------------------


class DeferredWorkView(Protocol):
    """The runner's start-up work left for after serving begins (engine/runner/deferred.py), as the core paces it."""

    @property
    def pending(self) -> bool: ...

    @property
    def next_ready(self) -> bool: ...

    @property
    def next_needs_idle(self) -> bool: ...

    @property
    def next_speeds_up_steps(self) -> bool: ...

    @property
    def last_unit_seconds(self) -> float: ...


class DecodeGraphSizes(Protocol):
    @property
    def sizes(self) -> list[int]: ...  # batch sizes of the captured decode graphs (engine/runner/cuda_graphs.py)


class PieceBuckets(Protocol):
    @property
    def buckets(self) -> list[int]: ...  # token counts of the piecewise graphs (engine/runner/piecewise.py)


class StepRunner(Protocol):
    """What the engine core drives: one GPU's ModelRunner, or rank 0 of a tensor-parallel group."""

    @property
    def graphs(self) -> DecodeGraphSizes | None: ...

    @property
    def pieces(self) -> PieceBuckets | None: ...

    @property
    def deferred(self) -> DeferredWorkView: ...

    def launch(self, plan: StepPlan, previous: DeviceSample | None = None) -> DeviceSample | None: ...

    def close(self) -> None: ...


class RunnerStart(Protocol):
    """What bringing the runner up reports to the core (engine/runner/startup.py, StartedRunner)."""

    @property
    def model(self) -> CausalLM: ...

    @property
    def kv_plan(self) -> KVPlan: ...

    @property
    def preemption_mode(self) -> str: ...

    @property
    def num_cpu_blocks(self) -> int: ...

    @property
    def graph_capture_seconds(self) -> float: ...

    @property
    def phases(self) -> dict[str, float]: ...

    @property
    def weights_source(self) -> str: ...


class StartRunner(Protocol):
    """Starts the runner a core drives (engine/distributed/executor.py, start_engine_runner): the core is handed it,
    so that it never imports the runner or the tensor-parallel ranks above it.  Returns what the start reports, the
    runner, and every rank's KV plan."""

    def __call__(
        self, config: ResolvedConfig, info: ModelInfo, defer: bool = False
    ) -> tuple[RunnerStart, StepRunner, list[KVPlan]]: ...
