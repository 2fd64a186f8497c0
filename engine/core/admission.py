"""From a validated request to the sequences the scheduler runs: n > 1 fan-out, sampling spec, token masks.

This is the core's side of admission.  What crosses from the front to the core is a `ValidRequest`: plain data
(token ids, parameters, a compiled grammar's text), so the same request can be handed to a core in this process
or, through engine/loop/, to one in another process, and handed again to the next core when one dies
(`resumed`: the tokens each sequence had already produced, which the new core takes as given).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace
from typing import Any

from engine.bad_words import BadWordsMatcher
from engine.core.plan import SamplingSpec
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarCompiler, TokenMatcher


@dataclass(frozen=True)
class ValidRequest:
    """A prompt and parameters that passed `LLMEngine.validate`: a core takes it as it is."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # the effective limit (max_model_len - prompt when max_tokens is None)
    grammar: str | None = None  # structured outputs: the compiled constraint
    banned_token_ids: tuple[int, ...] = ()  # bad words of one token (a -inf bias)
    bad_word_sequences: tuple[tuple[int, ...], ...] = ()  # bad words of several tokens (a host mask)


class SequenceFactory:
    """Builds a request's sequences; owns the grammar compiler whose matchers mask their tokens."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = eos_token_ids
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self._arrival = itertools.count()

    def sequences(
        self,
        request_id: str,
        valid: ValidRequest,
        arrival: float | None = None,
        resumed: dict[int, list[int]] | None = None,
    ) -> list[Request]:
        """The sequences to add to the scheduler: the first one of a fresh n > 1 request computes the prompt and
        its siblings fork its blocks.  With `resumed` (sequence index -> tokens it produced under a core that
        died), each unfinished sequence goes alone: its prompt is the original prompt plus what it produced, with
        the remaining max_tokens and min_tokens; the prefix cache shares the prompt's blocks among them."""
        arrival = time.monotonic() if arrival is None else arrival
        if resumed is not None:
            return [self._resumed(request_id, i, valid, produced, arrival) for i, produced in sorted(resumed.items())]
        seqs = [self._sequence(request_id, i, valid, arrival) for i in range(valid.params.n)]
        leader, siblings = seqs[0], seqs[1:]
        leader.forks = list(siblings)
        for seq in siblings:
            seq.held_by = leader
        return seqs

    def _sequence(self, request_id: str, index: int, valid: ValidRequest, arrival: float) -> Request:
        p = valid.params
        return Request(
            seq_id=f"{request_id}#{index}",
            parent_id=request_id,
            index=index,
            prompt_token_ids=valid.prompt_token_ids,
            params=p,
            max_tokens=valid.max_tokens,
            arrival_order=next(self._arrival),
            sampling=self.sampling_spec(p, index, valid.banned_token_ids),
            grammar=self._matcher(valid),
            arrival_time=arrival,
        )

    def _resumed(
        self, request_id: str, index: int, valid: ValidRequest, produced: list[int], arrival: float
    ) -> Request:
        seq = self._sequence(request_id, index, valid, arrival)
        seq.prompt_token_ids = list(valid.prompt_token_ids) + list(produced)
        seq.max_tokens = valid.max_tokens - len(produced)
        spec = seq.sampling
        seq.sampling = replace(
            spec,
            min_tokens=max(0, spec.min_tokens - len(produced)),
            # already delivered with the first token
            prompt_logprobs=spec.prompt_logprobs if not produced else None,
            # a seeded sequence draws token k's numbers from (seed, k) (engine/runner/sampler.py): it goes on
            # where it stopped
            seed_offset=spec.seed_offset + len(produced),
        )
        if seq.grammar is not None:
            for token in produced:  # the mask follows the output from where it is
                seq.grammar.accept(token)
        return seq

    def _matcher(self, valid: ValidRequest) -> TokenMatcher | None:
        """The sequence's host-side token mask (structured outputs, multi-token bad words), or None."""
        matcher: TokenMatcher | None = None if valid.grammar is None else self.grammars.matcher(valid.grammar)
        if valid.bad_word_sequences:
            matcher = BadWordsMatcher(valid.bad_word_sequences, self.grammars.mask_words, self.eos_token_ids, matcher)
        return matcher

    def sampling_spec(self, p: SamplingParams, index: int, banned: tuple[int, ...] = ()) -> SamplingSpec:
        stops: tuple[int, ...] = ()
        if p.min_tokens > 0:  # vLLM: EOS (unless ignored) and stop_token_ids wait for min_tokens
            eos = () if p.ignore_eos else tuple(sorted(self.eos_token_ids))
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
