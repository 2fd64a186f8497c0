"""Structured outputs: JSON schema, JSON object, regex, choice and grammar constraints on what a request
may generate, compiled at admission and enforced by a token mask every step.

The grammar engine is llguidance (https://github.com/guidance-ai/llguidance): compile time is paid at admission and the
slowest mask every step, so the tails decide, and its tails were several times shorter than xgrammar's
(docs/decisions/grammar-engine.md).  It is also one self-contained wheel and reads Lark and GBNF grammars, regexes and
choices as well as JSON schemas.

The host keeps one matcher per sequence: the scheduler asks it for the next token mask when it plans
a step (sent with the plan, so tensor-parallel ranks apply the same mask) and feeds it every token it
accepts.  A mask needs the previous token, so while a constrained sequence runs, the engine core
reads each step's tokens before it plans the next (no async overlap for that time).

An object schema that names its properties admits no others unless it says `additionalProperties` itself
(`close_objects`).  JSON Schema's own default admits any extra key, and a model that may add keys writes new ones
until max_tokens (a forced tool call came back as `{"city": "...", "ood to explain, it may be ...`).  This is
vLLM's default: its default backend compiles schemas in xgrammar's strict mode, which treats such an object as
closed, and its llguidance backend does the same with `disable_additional_properties`.  A schema that wants extra
keys says `"additionalProperties": true` (or gives their schema).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import structlog

from engine.sampling_params import SamplingParamsError, StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of its stubs

log = structlog.get_logger("pagekeeper.structured_output")

_COMPACT: JsonCompileOptions = {"whitespace_flexible": False}


class TokenMatcher(Protocol):
    """What the scheduler asks of a sequence's host-side token mask (a grammar, bad words, or both)."""

    @property
    def mask_words(self) -> int: ...
    @property
    def finished(self) -> bool: ...  # nothing may follow: the sequence ends
    @property
    def rejected(self) -> bool: ...  # a token outside the mask was sampled: the sequence ends as aborted

    def fill(self, row: np.ndarray) -> None: ...
    def accept(self, token: int) -> None: ...


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, mask_words: int) -> None:
        self._m = matcher
        self.mask_words = mask_words
        # The grammar is complete and nothing may follow: the sequence ends here (finish reason
        # "stop"), without waiting for the model to choose EOS, the only token the mask would allow.
        self.finished = False
        # A token the grammar refused: the request's other constraints (allowed_token_ids, logit_bias -100, bad
        # words) left no token the grammar allows, so one outside the mask was sampled.  The sequence ends
        # ("abort"); raising instead would fail the step, and with it every other request in the batch.
        self.rejected = False

    def fill(self, row: np.ndarray) -> None:
        """Write the next token's mask (bit t of word t // 32 set: token t allowed) into `row`."""
        assert row.dtype == np.int32 and row.flags.c_contiguous
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token: int) -> None:
        if self.finished:
            return
        if not self._m.consume_token(token):
            lines = self._m.get_error().strip().splitlines()
            error = next((ln for ln in lines if ln.startswith("Error:")), lines[0] if lines else "")
            log.warning("grammar_rejected_token", token=token, error=error)
            self.rejected = self.finished = True
            return
        self.finished = bool(self._m.is_stopped())


# Keywords whose value maps names to subschemas, and those whose value is a subschema or a list of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (
    "additionalProperties", "unevaluatedProperties", "propertyNames", "items", "prefixItems", "additionalItems",
    "unevaluatedItems", "contains", "not", "if", "then", "else", "allOf", "anyOf", "oneOf",
)  # fmt: skip


def close_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object that names its properties and says nothing of others admits none
    (`"additionalProperties": false`), at any depth; see the module's docstring for why."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = close_objects(out[key])
    names_properties = isinstance(out.get("properties"), dict) or isinstance(out.get("patternProperties"), dict)
    if names_properties and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _closed_schema_text(text: str) -> str:
    try:
        schema = json.loads(text)
    except ValueError:
        return text  # not JSON: llguidance says what is wrong with it
    return json.dumps(close_objects(schema))


class GrammarUnavailable(ValueError):
    """This model's tokenizer cannot take a grammar (the reason says what to change)."""


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (admission runs on server threads)."""

    CACHE = 256  # compiled grammars kept (applications resend the same schema)

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def _llg_tokenizer(self) -> Any:
        """Built on first use: a second or so for a 128k vocabulary, paid once.

        The grammar engine ends a grammar on an EOS token its tokenizer knows: a checkpoint's EOS id past the
        tokenizer's vocabulary (an embedding padded beyond it, say) is left out, and one with no EOS inside it is
        refused per request with the reason, instead of failing inside llguidance."""
        if self._tokenizer is None:
            import copy

            import llguidance

            known = sorted(i for i in self.eos_ids if i < len(self._hf))
            if self.eos_ids and not known:
                raise GrammarUnavailable(
                    f"the model's EOS token ids {sorted(self.eos_ids)} all lie outside its tokenizer's "
                    f"{len(self._hf)} tokens, so no grammar could end; fix eos_token_id in the checkpoint's "
                    "config.json or generation_config.json"
                )
            backend = getattr(self._hf, "backend_tokenizer", None)
            if backend is None:
                raise GrammarUnavailable("the model's tokenizer is not a fast (tokenizers-library) tokenizer")
            # What llguidance.hf.from_tokenizer does, without its transformers import: the serialized Rust
            # tokenizer (added tokens included), padding and truncation off, on a copy.
            backend = copy.copy(backend)
            backend.no_padding()
            backend.no_truncation()
            eos = known or self._hf.eos_token_id
            self._tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The checked grammar; a SamplingParamsError naming the field if it cannot be compiled."""
        import llguidance

        fmt, text = params.source()
        key = (fmt, text)
        with self._lock:
            try:
                tokenizer = self._llg_tokenizer()
            except GrammarUnavailable as e:
                raise SamplingParamsError(
                    params.param, f"{params.param}: structured outputs are unavailable: {e}"
                ) from e
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            try:
                if fmt == "json":  # compact JSON: a model cannot spend its tokens on whitespace
                    grammar = llguidance.LLMatcher.grammar_from_json_schema(
                        _closed_schema_text(text), defaults=_COMPACT
                    )
                else:
                    grammar = llguidance.grammar_from(fmt, text)
                error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
            except (ValueError, TypeError) as e:
                error = str(e)
            if error:
                first = error.strip().splitlines()[0]
                raise SamplingParamsError(params.param, f"{params.param}: the {fmt} cannot be compiled: {first}")
            self._cache[key] = grammar
            if len(self._cache) > self.CACHE:
                self._cache.popitem(last=False)
            return grammar

    def matcher(self, grammar: str) -> GrammarMatcher:
        import llguidance

        m = llguidance.LLMatcher(self._llg_tokenizer(), grammar)
        if m.is_error():
            raise SamplingParamsError("structured_outputs", f"structured_outputs: {m.get_error()}")
        return GrammarMatcher(m, self.mask_words)
