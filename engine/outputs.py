"""What generation returns: vLLM-compatible RequestOutput / CompletionOutput / Logprob."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of a request's life; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    output_token_counts: list[int] = field(default_factory=list)  # per output sequence, set when finished


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    # vLLM's prompt_logprobs: None for the first prompt token, then {token: Logprob} holding the prompt
    # token and the request's top-k at each position (when the request asked for prompt_logprobs).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
