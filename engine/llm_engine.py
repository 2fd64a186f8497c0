"""The engine's front: tokenize, validate, fan a request out into its n sequences, and reassemble.

Validation here is admission control: a request that could never complete (too long for
max_model_len, or needing more KV blocks than the whole pool) is refused before it is queued,
with an error naming the parameter, instead of sitting in the queue forever.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Union

from engine.bad_words import BadWordsMatcher, tokenize_bad_words
from engine.config import EngineConfig, ResolvedConfig
from engine.core.deltas import SeqDelta
from engine.core.engine_core import EngineCore, RecycleReport
from engine.core.plan import SamplingSpec
from engine.core.request import Request, RequestStatus
from engine.generation_defaults import load_generation_defaults
from engine.kv.kv_cache_manager import blocks_for_tokens
from engine.metrics import EngineSnapshot
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError
from engine.structured_output import GrammarCompiler, TokenMatcher

PromptType = Union[str, dict[str, Any], list[int]]


class RequestRejected(SamplingParamsError):
    """The request can never be served as given; `param` names what to change."""


@dataclass(frozen=True)
class Limits:
    """What a request is checked against; fixed at start-up, so any thread may read it."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int


@dataclass(frozen=True)
class ValidRequest:
    """A prompt and parameters that passed `LLMEngine.validate`: `add_request` takes it as it is."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # the effective limit (max_model_len - prompt when max_tokens is None)
    grammar: str | None = None  # structured outputs: the compiled constraint
    banned_token_ids: tuple[int, ...] = ()  # bad words of one token (a -inf bias)
    bad_word_sequences: tuple[tuple[int, ...], ...] = ()  # bad words of several tokens (a host mask)


class LLMEngine:
    def __init__(self, config: EngineConfig, defer_startup_work: bool = False) -> None:
        # read before the model: a --generation-config that is not there fails in a second, not after the load
        self.generation_defaults = load_generation_defaults(config)
        self.core = EngineCore(config, defer_startup_work)
        self.config: ResolvedConfig = self.core.config  # the limits the checkpoint gave
        self.tokenizer = self.core.tokenizer
        self.outputs = OutputProcessor(self.tokenizer)
        self.limits = Limits(
            int(self.core.model_info.hf_config.vocab_size),
            self.config.max_model_len,
            self.config.block_size,
            self.core.kv.num_blocks,
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.limits.vocab_size, self.core.eos_token_ids)
        self._seq_ids: dict[str, list[str]] = {}  # request id -> its sequences' ids
        self._arrival = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

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

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | ValidRequest,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind | None = None,
    ) -> list[str]:
        """Queue a request (validated here unless it is a `ValidRequest` already); its sequence ids."""
        if request_id in self.outputs:
            raise RequestRejected("request_id", f"request id {request_id!r} is already in flight")
        if isinstance(prompt, ValidRequest):
            valid = prompt
        else:
            assert params is not None
            text, ids = self.tokenize(prompt)
            valid = self.validate(ids, params, text)
        params = valid.params
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = [self._make_sequence(request_id, i, valid, arrival) for i in range(params.n)]
        leader, siblings = seqs[0], seqs[1:]
        # Only the first sequence computes the prompt; the others fork its blocks when it is done.
        leader.forks = list(siblings)
        for seq in siblings:
            seq.held_by = leader
        self.outputs.add(
            request_id, valid.prompt, valid.prompt_token_ids, params, output_kind or params.output_kind, arrival
        )
        self.core.add(leader)
        self._seq_ids[request_id] = [s.seq_id for s in seqs]
        return self._seq_ids[request_id]

    def validate(self, ids: list[int], params: SamplingParams, prompt: str | None = None) -> ValidRequest:
        """Raise RequestRejected unless the request can be served.

        Reads only settings fixed at start-up, so any thread may call it.
        """
        if not ids:
            raise RequestRejected("prompt", "the prompt is empty")
        keep = params.truncate_prompt_tokens
        if keep is not None and len(ids) > keep:
            ids, prompt = ids[-keep:], None  # the text no longer matches the ids
        lim = self.limits
        vocab = lim.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestRejected("prompt", f"prompt token ids must be in [0, {vocab})")
        for field, token_ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("stop_token_ids", params.stop_token_ids or ()),
        ):
            bad = [t for t in token_ids if t >= vocab]
            if bad:
                raise RequestRejected(field, f"{field} has token id {bad[0]}; the vocabulary is [0, {vocab})")
        limit = lim.max_model_len
        if len(ids) >= limit:  # the prompt itself is too long, whatever max_tokens says: the prompt is named
            raise RequestRejected(
                "prompt",
                f"the prompt has {len(ids)} tokens; this model's maximum context length is {limit} tokens "
                "(max_model_len), the output included: shorten the prompt",
            )
        if params.max_tokens is None:
            max_tokens = limit - len(ids)
            if "max_tokens" in self.generation_defaults:  # the checkpoint's max_new_tokens, within what fits
                max_tokens = max(1, min(max_tokens, int(self.generation_defaults["max_tokens"])))
        else:
            max_tokens = params.max_tokens
            if len(ids) + max_tokens > limit:
                raise RequestRejected(
                    "max_tokens",
                    f"the prompt has {len(ids)} tokens and max_tokens asks for {max_tokens} more, "
                    f"{len(ids) + max_tokens} in all; this model's maximum context length is {limit} tokens "
                    f"(max_model_len): lower max_tokens to {limit - len(ids)} or shorten the prompt",
                )
        # The last sampled token never needs KV, so a sequence holds at most prompt + max_tokens - 1.
        blocks = blocks_for_tokens(len(ids) + max_tokens - 1, lim.block_size)
        if blocks > lim.num_blocks:
            raise RequestRejected(
                "max_tokens",
                f"prompt + max_tokens needs {blocks} KV blocks but the whole cache has {lim.num_blocks}",
            )
        grammar = None
        if params.structured_outputs is not None:
            try:
                grammar = self.grammars.compile(params.structured_outputs)
            except SamplingParamsError as e:
                raise RequestRejected(e.param, str(e)) from e
        banned: tuple[int, ...] = ()
        sequences: tuple[tuple[int, ...], ...] = ()
        if params.bad_words:
            banned, sequences = tokenize_bad_words(self.tokenizer, params.bad_words)
            if grammar is not None:  # one host mask for both, so that one that leaves nothing is seen (BadWordsMatcher)
                sequences, banned = sequences + tuple((t,) for t in banned), ()
        return ValidRequest(prompt, ids, params, max_tokens, grammar, banned, sequences)

    def _make_sequence(self, request_id: str, index: int, valid: ValidRequest, arrival: float) -> Request:
        p = valid.params
        return Request(
            seq_id=f"{request_id}#{index}",
            parent_id=request_id,
            index=index,
            prompt_token_ids=valid.prompt_token_ids,
            params=p,
            max_tokens=valid.max_tokens,
            arrival_order=next(self._arrival),
            sampling=self._sampling_spec(p, index, valid.banned_token_ids),
            grammar=self._matcher(valid),
            arrival_time=arrival,
        )

    def _matcher(self, valid: ValidRequest) -> TokenMatcher | None:
        """The sequence's host-side token mask (structured outputs, multi-token bad words), or None."""
        matcher: TokenMatcher | None = None if valid.grammar is None else self.grammars.matcher(valid.grammar)
        if valid.bad_word_sequences:
            matcher = BadWordsMatcher(
                valid.bad_word_sequences, self.grammars.mask_words, self.core.eos_token_ids, matcher
            )
        return matcher

    def _sampling_spec(self, p: SamplingParams, index: int, banned: tuple[int, ...] = ()) -> SamplingSpec:
        stops: tuple[int, ...] = ()
        if p.min_tokens > 0:  # vLLM: EOS (unless ignored) and stop_token_ids wait for min_tokens
            eos = () if p.ignore_eos else tuple(sorted(self.core.eos_token_ids))
            stops = tuple(dict.fromkeys(eos + tuple(p.stop_token_ids or ())))
        return SamplingSpec(
            p.temperature,
            p.top_p,
            p.top_k,
            p.logprobs,
            None if p.seed is None else p.seed + index,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            min_p=p.min_p,
            min_tokens=p.min_tokens,
            min_tokens_stop_ids=stops,
            logit_bias=tuple(sorted({**(p.logit_bias or {}), **dict.fromkeys(banned, float("-inf"))}.items())),
            allowed_token_ids=None if p.allowed_token_ids is None else tuple(sorted(set(p.allowed_token_ids))),
            prompt_logprobs=p.prompt_logprobs,
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq_ids = self._seq_ids.pop(request_id, None)
        if seq_ids is None:
            return None
        for sid in seq_ids:
            self.core.finish(sid, RequestStatus.FINISHED_ABORTED)
        return self.outputs.abort(request_id, time.monotonic())

    def request_ids(self) -> list[str]:
        return self.outputs.request_ids()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def num_unfinished_requests(self) -> int:
        return len(self.outputs)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes now (at exit they are stopped anyway)."""
        self.core.close()

    def stats(self) -> EngineSnapshot:
        """Plain numbers for the metrics layer, taken between steps."""
        return self.core.snapshot()

    def recycle(self) -> tuple[list[RequestOutput], RecycleReport]:
        """Rebuild the KV pool in place (EngineCore.recycle); the outputs of the step it finished reading."""
        deltas, report = self.core.recycle()
        return self._outputs(deltas), report

    def has_deferred_work(self) -> bool:
        return self.core.has_deferred_work()

    def run_deferred(self) -> None:
        self.core.run_deferred()

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One engine step; outputs for every request that advanced (as its output kind asks),
        finished ones last seen here.  `finished_only` keeps only the finished ones."""
        outputs = self._outputs(self.core.step())
        if finished_only:
            return [o for o in outputs if o.finished]
        return outputs

    def _outputs(self, deltas: list[SeqDelta]) -> list[RequestOutput]:
        processed = self.outputs.process(deltas, time.monotonic())
        for seq_id, stop in processed.stopped:
            self.core.finish(seq_id, RequestStatus.FINISHED_STOPPED, stop)
        outputs = processed.outputs
        for out in outputs:
            if out.finished:
                self._seq_ids.pop(out.request_id, None)
        return outputs
