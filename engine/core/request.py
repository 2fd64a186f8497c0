"""One sequence as the scheduler sees it: its tokens, how many have KV, and its state.

A user request with n > 1 becomes n of these (one per output sequence), so the scheduler, the KV
manager and the runner only ever deal with single sequences.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.core.deltas import PromptLogprob
from engine.core.plan import PromptLogprobsChunk, SamplingSpec
from engine.sampling_params import SamplingParams
from engine.structured_output import TokenMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    seq_id: str
    parent_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_order: int
    sampling: SamplingSpec = field(default_factory=SamplingSpec)  # what the runner samples with
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # n > 1: the first sequence computes the prompt; its siblings wait here and fork its blocks
    # (and sample from its logits) the moment the prompt is done.
    forks: list[Request] = field(default_factory=list)
    held_by: Request | None = None
    # Tokens sampled by a step still on the device (async scheduling): they count in num_tokens, so
    # the next step can be scheduled before they are read, and the runner feeds the newest one to
    # the next step from the device, from row `pending_row` of its step's samples.
    num_pending: int = 0
    pending_row: int = -1
    # What the runner knows of this sequence: whether it has its sampling state, and the block
    # table it was last sent (a plan sends only the change).
    known_to_runner: bool = False
    sent_table: list[int] = field(default_factory=list)
    # Prompt logprobs, filled by position as the prefill computes them (position 0 has none).
    prompt_logprobs: list[PromptLogprob | None] | None = None
    prompt_logprobs_filled: int = 0
    grammar: TokenMatcher | None = None  # structured outputs / bad words: where the output is in its mask
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float = 0.0  # when the host read its newest token (inter-token latency)
    finished_time: float | None = None

    @property
    def prompt_logprobs_done(self) -> bool:
        """Nothing is left to compute for prompt logprobs (n > 1 siblings take the first sequence's)."""
        if self.sampling.prompt_logprobs is None or self.index > 0:
            return True
        return self.prompt_logprobs_filled >= self.num_prompt_tokens - 1

    def record_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        """Positions computed again after a preemption (recompute) are already there: kept once."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * self.num_prompt_tokens
        for i, lp in enumerate(chunk.logprobs):
            pos = chunk.first_position + i
            if self.prompt_logprobs[pos] is None:
                self.prompt_logprobs_filled += 1
            top = chunk.top[i] if chunk.top is not None else {}
            self.prompt_logprobs[pos] = (lp, chunk.ranks[i], top)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has read (prompt and accepted output)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def reaches_max_tokens(self) -> bool:
        """The tokens already sampled (read or pending) exhaust max_tokens: nothing more to compute."""
        return len(self.output_token_ids) + self.num_pending >= self.max_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
