"""Incremental detokenization: text deltas as tokens arrive, in O(1) work per token.

Decoding the whole output every step is quadratic and, for byte-level BPE, a single token can end
in the middle of a UTF-8 character.  So each step decodes only a short window of recent tokens,
emits the text that the newest token added, and holds back text that ends in an incomplete
character until the next token completes it.  Stop strings are matched here too, because they
are a property of the text, not of token ids.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5  # tokens of left context kept so that tokenizers that merge spaces decode right


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop_strings: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        # A fast tokenizer's Rust core decodes ~10x quicker than transformers' Python wrapper, and the
        # wrapper adds nothing here (no clean-up of spaces); this runs once per token per request.
        backend = getattr(tokenizer, "_tokenizer", None)
        self._rust_decode = getattr(backend, "decode", None) if getattr(tokenizer, "is_fast", False) else None
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop_strings = stop_strings
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens  # vLLM: stop strings count only once min_tokens are out
        self._num_tokens = 0
        self.text = ""
        self.stopped: str | None = None  # the stop string that ended the text; later tokens are ignored

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed, if any (text is then truncated)."""
        if self.stopped is not None:
            return None
        self._ids.append(token_id)
        self._num_tokens += 1
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        before = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if len(self._ids) > 4 * _CONTEXT_TOKENS:  # keep the window bounded
            drop = self._prefix_offset
            self._ids = self._ids[drop:]
            self._prefix_offset -= drop
            self._read_offset -= drop
        if self._num_tokens < self._min_tokens:
            return None
        return self._check_stop(before)

    def _check_stop(self, new_text_start: int) -> str | None:
        for stop in self._stop_strings:
            search_from = max(0, new_text_start - len(stop) + 1)
            idx = self.text.find(stop, search_from)
            if idx != -1:
                self.text = self.text[: idx + len(stop)] if self._include_stop else self.text[:idx]
                self.stopped = stop
                return stop
        return None

    def _decode(self, ids: list[int]) -> str:
        if self._rust_decode is not None:
            return str(self._rust_decode(ids, skip_special_tokens=self._skip_special))
        return str(
            self._tokenizer.decode(ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False)
        )
