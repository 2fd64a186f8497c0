"""From the core's token deltas to what callers read: text, stop strings, logprobs, n > 1 reassembly.

The core emits each sequence's new token once; this is the one place that turns tokens into text
(incrementally), ends a sequence on a stop string, and groups a request's n sequences into one
`RequestOutput`.  How much an output holds is the request's `RequestOutputKind`: a stream asks for
DELTA and gets only the new part (O(1) per token, however long the output grows), the offline API
asks for FINAL_ONLY and gets one output at the end; CUMULATIVE rebuilds everything every step, as
vLLM's default does, for callers of `LLMEngine.step()` that want that.

A DELTA stream holds back the last `max(len(stop)) - 1` characters while the sequence runs, so a
client never receives text that a stop string completed later would have cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.deltas import PromptLogprob, SeqDelta
from engine.core.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass(eq=False)
class _Sequence:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_sent: int = 0  # DELTA: characters and tokens already handed out
    tokens_sent: int = 0


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    hold_back: int
    seqs: list[_Sequence]
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


@dataclass
class Processed:
    outputs: list[RequestOutput]  # for the requests that advanced, finished ones last seen here
    stopped: list[tuple[str, str]]  # (seq_id, stop string): sequences the core must end now


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kind: RequestOutputKind,
        arrival_time: float,
    ) -> None:
        seqs = [
            _Sequence(
                i,
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    params.skip_special_tokens,
                    params.stop_strings,
                    params.include_stop_str_in_output,
                    params.min_tokens,
                ),
                logprobs=[] if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]
        hold_back = max((len(s) for s in params.stop_strings), default=1) - 1
        self._requests[request_id] = _Request(request_id, prompt, prompt_token_ids, kind, hold_back, seqs, arrival_time)

    def process(self, deltas: list[SeqDelta], now: float) -> Processed:
        touched: dict[str, _Request] = {}
        stopped: list[tuple[str, str]] = []
        for d in deltas:
            req = self._requests.get(d.parent_id)
            if req is None:
                continue
            touched[req.request_id] = req
            seq = req.seqs[d.index]
            if seq.finish_reason is not None:  # ended by a stop string while this token was computed
                continue
            if d.prompt_logprobs is not None and req.prompt_logprobs is None:
                req.prompt_logprobs = [
                    None if e is None else _prompt_entry(req, i, e) for i, e in enumerate(d.prompt_logprobs)
                ]
            if d.first_scheduled_time is not None and req.first_scheduled_time is None:
                req.first_scheduled_time = d.first_scheduled_time
            if d.token_id is not None:
                if req.first_token_time is None:
                    req.first_token_time = d.first_token_time if d.first_token_time is not None else now
                self._append(seq, d)
                stop = seq.detokenizer.add_token(d.token_id)
                if stop is not None:  # the stop string wins over a length / EOS end of the same token
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    if d.finish_reason is None:
                        stopped.append((d.seq_id, stop))
                    continue
            if d.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = d.finish_reason, d.stop_reason
        outputs = []
        for req in touched.values():
            out = self._output(req, now)
            if out is not None:
                outputs.append(out)
        return Processed(outputs, stopped)

    def abort(self, request_id: str, now: float) -> RequestOutput | None:
        """End every sequence of the request; its final output (None if it was not running)."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        return self._output(req, now)

    @staticmethod
    def _append(seq: _Sequence, d: SeqDelta) -> None:
        assert d.token_id is not None
        seq.token_ids.append(d.token_id)
        if seq.logprobs is not None and d.logprob is not None:
            top = d.top_logprobs or {}
            entry = {t: Logprob(v, rank=r + 1) for r, (t, v) in enumerate(top.items())}
            entry.setdefault(d.token_id, Logprob(d.logprob))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += d.logprob

    def _output(self, req: _Request, now: float) -> RequestOutput | None:
        finished = req.finished
        if finished:
            req.finished_time = now
            del self._requests[req.request_id]
        elif req.kind is RequestOutputKind.FINAL_ONLY:
            return None
        delta = req.kind is RequestOutputKind.DELTA
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finished_time)
        if finished:
            metrics.output_token_counts = [len(s.token_ids) for s in req.seqs]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[self._delta(req, s) if delta else self._whole(s) for s in req.seqs],
            finished=finished,
            metrics=metrics,
            prompt_logprobs=req.prompt_logprobs,
        )

    @staticmethod
    def _whole(seq: _Sequence) -> CompletionOutput:
        wants = seq.logprobs is not None
        return CompletionOutput(
            index=seq.index,
            text=seq.detokenizer.text,
            token_ids=list(seq.token_ids),
            cumulative_logprob=seq.cumulative_logprob if wants else None,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    @staticmethod
    def _delta(req: _Request, seq: _Sequence) -> CompletionOutput:
        """Only what is new since the last output, holding back a possible stop string's start."""
        text = seq.detokenizer.text
        done = seq.finish_reason is not None
        start = seq.text_sent
        end = len(text) if done else max(start, len(text) - req.hold_back)
        tok_start = seq.tokens_sent
        seq.text_sent, seq.tokens_sent = end, len(seq.token_ids)
        return CompletionOutput(
            index=seq.index,
            text=text[start:end],
            token_ids=seq.token_ids[tok_start:],
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=seq.logprobs[tok_start:] if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )


def _prompt_entry(req: _Request, position: int, entry: PromptLogprob) -> dict[int, Logprob]:
    """vLLM's shape: the prompt token with its rank, then the top-k by rank."""
    logprob, rank, top = entry
    out = {req.prompt_token_ids[position]: Logprob(logprob, rank=rank)}
    for r, (token, value) in enumerate(top.items()):
        out.setdefault(token, Logprob(value, rank=r + 1))
    return out
