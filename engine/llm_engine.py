"""The engine's front: tokenize, validate, fan a request out into its n sequences, and reassemble.

Validation here is admission control: a request that could never complete (too long for
max_model_len, or needing more KV blocks than the whole pool) is refused before it is queued,
with an error naming the parameter, instead of sitting in the queue forever.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Union

from engine.config import EngineConfig
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.engine_core import EngineCore
from engine.core.request import Request
from engine.kv.kv_cache_manager import blocks_for_tokens
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams, SamplingParamsError

PromptType = Union[str, dict[str, Any], list[int]]


class RequestRejected(SamplingParamsError):
    """The request can never be served as given; `param` names what to change."""


@dataclass(eq=False)
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]

    def finished(self) -> bool:
        return all(s.status.finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self._parents: dict[str, ParentRequest] = {}
        self._arrival = itertools.count()
        self._seed_counter = itertools.count()

    @property
    def max_model_len(self) -> int:
        assert self.config.max_model_len is not None
        return self.config.max_model_len

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise RequestRejected("prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return None, [int(t) for t in prompt]

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None) -> ParentRequest:
        if request_id in self._parents:
            raise RequestRejected("request_id", f"request id {request_id!r} is already in flight")
        text, ids = self.tokenize(prompt)
        max_tokens = self.validate(ids, params)
        parent = ParentRequest(request_id, text, ids, [])
        for i in range(params.n):
            seq = self._make_sequence(parent, i, params, max_tokens, arrival_time)
            parent.seqs.append(seq)
        leader, siblings = parent.seqs[0], parent.seqs[1:]
        # Only the first sequence computes the prompt; the others fork its blocks when it is done.
        leader.forks = list(siblings)
        for seq in siblings:
            seq.held_by = leader
        self.core.add(leader)
        self._parents[request_id] = parent
        return parent

    def validate(self, ids: list[int], params: SamplingParams) -> int:
        """Raise RequestRejected unless the request can be served; returns its effective max_tokens.

        Reads only settings fixed at start-up, so any thread may call it.
        """
        if not ids:
            raise RequestRejected("prompt", "the prompt is empty")
        vocab = self.core.model_info.hf_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestRejected("prompt", f"prompt token ids must be in [0, {vocab})")
        limit = self.max_model_len
        if params.max_tokens is None:
            if len(ids) >= limit:
                raise RequestRejected("prompt", f"the prompt has {len(ids)} tokens; max_model_len is {limit}")
            max_tokens = limit - len(ids)
        else:
            max_tokens = params.max_tokens
            if len(ids) + max_tokens > limit:
                raise RequestRejected(
                    "max_tokens",
                    f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} "
                    f"exceeds max_model_len {limit}; shorten the prompt or lower max_tokens",
                )
        # The last sampled token never needs KV, so a sequence holds at most prompt + max_tokens - 1.
        blocks = blocks_for_tokens(len(ids) + max_tokens - 1, self.config.block_size)
        if blocks > self.core.kv.num_blocks:
            raise RequestRejected(
                "max_tokens",
                f"prompt + max_tokens needs {blocks} KV blocks but the whole cache has {self.core.kv.num_blocks}",
            )
        return max_tokens

    def _make_sequence(self, parent: ParentRequest, index: int, params: SamplingParams,
                       max_tokens: int, arrival_time: float | None) -> Request:
        generator = None
        if params.seed is not None:
            generator = self.core.runner.make_generator(params.seed + index)
        seq = Request(
            seq_id=f"{parent.request_id}#{index}",
            parent_id=parent.request_id,
            index=index,
            prompt_token_ids=parent.prompt_token_ids,
            params=params,
            max_tokens=max_tokens,
            eos_token_id=None,
            arrival_order=next(self._arrival),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, parent.prompt_token_ids, params.skip_special_tokens,
                params.stop_strings, params.include_stop_str_in_output,
            ),
            generator=generator,
        )
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        for seq in parent.seqs:
            self.core.abort(seq)
        return self._output(parent)

    def request_ids(self) -> list[str]:
        return list(self._parents)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One engine step; outputs for every request that advanced, finished ones last seen here.

        `finished_only` skips building outputs for requests still running (the offline API reads
        only final outputs; building one per token per request costs more than the step's bookkeeping).
        """
        touched = self.core.step()
        seen: dict[str, ParentRequest] = {}
        for seq in touched:
            parent = self._parents.get(seq.parent_id)
            if parent is not None:
                seen[parent.request_id] = parent
        outputs = []
        for parent in seen.values():
            finished = parent.finished() and not any(self.core.has_pending_output(s) for s in parent.seqs)
            if finished:
                del self._parents[parent.request_id]
            elif finished_only:
                continue
            outputs.append(self._output(parent, finished))
        return outputs

    def _output(self, parent: ParentRequest, finished: bool | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[_completion(s) for s in parent.seqs],
            finished=parent.finished() if finished is None else finished,
            metrics=_timing(parent.seqs),
        )


def _completion(seq: Request) -> CompletionOutput:
    wants_logprobs = seq.params.logprobs is not None
    logprobs = None
    if wants_logprobs:
        logprobs = []
        for tok, lp, top in zip(seq.output_token_ids, seq.output_logprobs, seq.output_top_logprobs):
            entry = {t: Logprob(v, rank=r + 1) for r, (t, v) in enumerate(top.items())}
            entry.setdefault(tok, Logprob(lp))
            logprobs.append(entry)
    return CompletionOutput(
        index=seq.index,
        text=seq.output_text,
        token_ids=list(seq.output_token_ids),
        cumulative_logprob=sum(seq.output_logprobs) if wants_logprobs else None,
        logprobs=logprobs,
        finish_reason=seq.status.value if seq.status.finished else None,
        stop_reason=seq.stop_reason,
    )


def _timing(seqs: list[Request]) -> RequestMetrics:
    def first(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return min(present) if present else None

    finished = [s.finished_time for s in seqs]
    return RequestMetrics(
        arrival_time=min(s.arrival_time for s in seqs),
        first_scheduled_time=first([s.first_scheduled_time for s in seqs]),
        first_token_time=first([s.first_token_time for s in seqs]),
        finished_time=max(finished) if all(f is not None for f in finished) else None,  # type: ignore[type-var]
    )
