"""The engine's front: tokenize, validate, fan a request out into its n sequences, and reassemble.

Validation here is admission control: a request that could never complete (too long for
max_model_len, or needing more KV blocks than the whole pool) is refused before it is queued,
with an error naming the parameter, instead of sitting in the queue forever.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, Union

from engine.bad_words import tokenize_bad_words
from engine.config import EngineConfig, ResolvedConfig
from engine.core.admission import ValidRequest
from engine.core.deltas import SeqDelta
from engine.core.facts import CoreFacts, RecycleReport
from engine.core.request import RequestStatus
from engine.generation_defaults import load_generation_defaults
from engine.kv.kv_cache_manager import blocks_for_tokens
from engine.loop.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError
from engine.stats import EngineSnapshot
from engine.structured_output import GrammarCompiler

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


class Core(Protocol):
    """What the front asks of a core: engine/core/engine_core.py in this process, or engine/loop/remote.py's
    handle on one in another process."""

    @property
    def facts(self) -> CoreFacts: ...
    def admit(
        self,
        request_id: str,
        valid: ValidRequest,
        arrival: float | None = None,
        resumed: dict[int, list[int]] | None = None,
    ) -> list[str]: ...
    def finish(self, seq_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> bool: ...
    def step(self) -> list[SeqDelta]: ...
    def has_unfinished(self) -> bool: ...
    def snapshot(self) -> EngineSnapshot: ...
    def recycle(self) -> tuple[list[SeqDelta], RecycleReport]: ...
    def has_deferred_work(self) -> bool: ...
    def run_deferred(self) -> None: ...
    def wake(self) -> None: ...
    def close(self) -> None: ...


class LLMEngine:
    def __init__(self, config: EngineConfig, defer_startup_work: bool = False, core: Core | None = None) -> None:
        """A core in this process unless `core` is given (a front whose core runs elsewhere: engine/loop/)."""
        # read before the model: a --generation-config that is not there fails in a second, not after the load
        self.generation_defaults = load_generation_defaults(config)
        if core is None:
            from engine.core.engine_core import EngineCore
            from engine.distributed.executor import start_engine_runner

            local = EngineCore(config, start_engine_runner, defer_startup_work)
            self.core: Core = local
            self.tokenizer = local.tokenizer
            self.grammars = local.sequences.grammars  # one compiler: the core's matchers reuse what validation compiled
        else:
            from engine.model.tokenizer_load import load_tokenizer

            self.core = core
            self.tokenizer = load_tokenizer(config)
            facts = core.facts
            self.grammars = GrammarCompiler(self.tokenizer, facts.vocab_size, facts.eos_token_ids)
        facts = self.core.facts
        self.config: ResolvedConfig = facts.config  # the limits the checkpoint gave
        self.outputs = OutputProcessor(self.tokenizer)
        self.limits = Limits(facts.vocab_size, self.config.max_model_len, self.config.block_size, facts.num_blocks)
        self._seq_ids: dict[str, list[str]] = {}  # request id -> its sequences' ids

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
        self.outputs.add(
            request_id, valid.prompt, valid.prompt_token_ids, params, output_kind or params.output_kind, arrival
        )
        self._seq_ids[request_id] = self.core.admit(request_id, valid, arrival)
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

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq_ids = self._seq_ids.pop(request_id, None)
        if seq_ids is None:
            return None
        for sid in seq_ids:
            self.core.finish(sid, RequestStatus.FINISHED_ABORTED)
        return self.outputs.abort(request_id, time.monotonic())

    def take_failed(self) -> list[tuple[str, str]]:
        """Requests a core in another process gave up (engine/loop/remote.py), with why; they are dropped."""
        take = getattr(self.core, "take_failed", None)
        failed: list[tuple[str, str]] = take() if take is not None else []
        for request_id, _ in failed:
            self._seq_ids.pop(request_id, None)
            self.outputs.abort(request_id, time.monotonic())
        return failed

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

    def wake(self) -> None:
        """Thread-safe: a `run_deferred` waiting for the core returns now (work was posted for the loop)."""
        self.core.wake()

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
