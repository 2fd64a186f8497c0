"""What the core emits per step: each sequence's new token, never its whole output.

A consumer that wants the whole output (the offline API) accumulates deltas; a stream forwards
them.  Either way a step costs O(sequences in the step), not O(tokens generated so far).
"""

from __future__ import annotations

from dataclasses import dataclass

# One prompt position's logprobs: (logprob of the prompt token there, its rank, top-k {token: logprob}).
PromptLogprob = tuple[float, int, dict[int, float]]


@dataclass(slots=True)
class SeqDelta:
    seq_id: str
    parent_id: str
    index: int  # the output sequence's index within its request (n > 1)
    token_id: int | None  # None: no new token, only the end (an abort)
    logprob: float | None = None  # of token_id, when the request asked for logprobs
    top_logprobs: dict[int, float] | None = None  # the request's top-k, most likely first
    finish_reason: str | None = None  # "stop", "length" or "abort" when this ends the sequence
    stop_reason: int | str | None = None  # the stop token id that ended it
    first_scheduled_time: float | None = None  # set with the sequence's first token
    # The clock reading the scheduler dated the first token with: the decode time and the inter-token gaps
    # then come from the same readings, so the gaps never add up to more than the decode time.
    first_token_time: float | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None  # with the first token; position 0 is None
