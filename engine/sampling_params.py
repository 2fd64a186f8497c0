"""How one request is decoded: the vLLM-compatible SamplingParams.

Validation happens here, once, with errors that name the offending parameter: the server turns a
`SamplingParamsError` into an HTTP 400 whose `param` is `error.param`.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Literal


class RequestOutputKind(enum.Enum):
    """What each output of a running request holds (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the last output: what a stream sends
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParamsError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one of these says what the output must match."""

    json: dict[str, Any] | str | None = None  # a JSON schema (a dict or its text)
    regex: str | None = None
    choice: list[str] | None = None  # the whole output is one of these strings
    grammar: str | None = None  # a Lark or GBNF grammar
    json_object: bool | None = None  # any JSON object
    param: str = "structured_outputs"  # the request field it came from, for error messages

    def source(self) -> tuple[Literal["json", "choice", "regex", "grammar"], str]:
        """(llguidance format, grammar text); a SamplingParamsError unless exactly one is set."""
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(self, name) not in (None, False)
        ]
        if len(given) != 1:
            what = "none" if not given else " and ".join(given)
            raise SamplingParamsError(
                self.param, f"{self.param} needs exactly one of json, regex, choice, grammar, json_object; got {what}"
            )
        kind = given[0]
        if kind == "json_object":
            return "json", '{"type": "object"}'
        if kind == "json":
            schema = self.json
            return "json", schema if isinstance(schema, str) else json.dumps(schema)
        if kind == "choice":
            choice = self.choice or []
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise SamplingParamsError(self.param, f"{self.param} choice must be a list of non-empty strings")
            return "choice", json.dumps(choice)
        fmt: Literal["regex", "grammar"] = "regex" if kind == "regex" else "grammar"  # the two left
        text = getattr(self, fmt)
        if not isinstance(text, str) or not text:
            raise SamplingParamsError(self.param, f"{self.param} {fmt} must be a non-empty string")
        return fmt, text


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (left truncation)
    prompt_logprobs: int | None = None  # top-k logprobs at every prompt position (0: the prompt token's only)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # never generated (vLLM's definition: engine/bad_words.py)
    best_of: int | None = None  # only best_of == n (nothing to choose among; vLLM's V1 engine has none either)
    structured_outputs: StructuredOutputsParams | None = None  # engine/structured_output.py
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = (self.stop,) if self.stop else ()
        else:
            self.stop_strings = tuple(s for s in (self.stop or []) if s)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k < 0:  # vLLM spells "disabled" as -1; we also accept 0
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        if self.n < 1:
            raise SamplingParamsError("n", f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise SamplingParamsError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise SamplingParamsError(
                "prompt_logprobs", f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"
            )
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise SamplingParamsError(
                "truncate_prompt_tokens", f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}"
            )
        if any(t < 0 for t in self.stop_token_ids or []):
            raise SamplingParamsError("stop_token_ids", "stop_token_ids must be non-negative token ids")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingParamsError("seed", f"seed must be in [0, 2**63), got {self.seed}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise SamplingParamsError(
                "presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise SamplingParamsError(
                "frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
            )
        if not 0.0 < self.repetition_penalty <= 2.0**16:
            raise SamplingParamsError(
                "repetition_penalty", f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise SamplingParamsError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0:
                raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids (>= 0), got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise SamplingParamsError("logit_bias", f"logit_bias values must be in [-100, 100], got {bias}")
        if self.structured_outputs is not None:
            self.structured_outputs.source()  # exactly one constraint, of the right type
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise SamplingParamsError("allowed_token_ids", "allowed_token_ids must not be empty")
            if any(t < 0 for t in self.allowed_token_ids):
                raise SamplingParamsError("allowed_token_ids", "allowed_token_ids must be token ids (>= 0)")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words
            ):
                raise SamplingParamsError("bad_words", "bad_words must be a list of non-empty strings")
            if len(self.bad_words) > 1024:
                raise SamplingParamsError("bad_words", f"bad_words has {len(self.bad_words)} words; at most 1024")
        if self.best_of is not None and self.best_of != self.n:
            raise SamplingParamsError("best_of", "best_of is not supported yet (only best_of == n); leave it out")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
