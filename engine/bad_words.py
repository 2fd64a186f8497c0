"""`bad_words`: words a request must never generate, with vLLM's definition.

Each word is tokenized as written and with a leading space (the form it takes mid-sentence).  A word of one
token is banned outright: a -inf logit bias, applied on the device with the other biases, no host round trip.
A word of several tokens bans only its last token, and only right after the output has ended with the others;
that depends on the previous token, so it runs on the host like a structured-output mask (the engine reads each
step before planning the next while such a request runs).  As in vLLM only the output is matched, not the prompt.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def tokenize_bad_words(tokenizer: Any, words: list[str]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(single-token words' ids, multi-token words' id sequences), each variant once."""
    seen: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
            if ids:
                seen.setdefault(ids)
    singles = tuple(sorted({ids[0] for ids in seen if len(ids) == 1}))
    return singles, tuple(ids for ids in seen if len(ids) > 1)


class BadWordsMatcher:
    """The structured-output matcher interface (fill / accept / finished) for multi-token bad words, wrapping the
    request's grammar matcher when it has one (both masks apply).

    A grammar and the bad words can leave no token at all (a choice that spells a bad word, half written).  Then
    only EOS is allowed and the sequence ends there ("stop"), instead of sampling from an empty mask, which would
    hand the grammar a token it must reject and fail the whole step for every request in it.
    """

    def __init__(
        self,
        sequences: tuple[tuple[int, ...], ...],
        mask_words: int,
        eos_token_ids: frozenset[int],
        inner: Any = None,
    ) -> None:
        self.sequences = sequences
        self.mask_words = mask_words
        self.eos_token_ids = sorted(eos_token_ids)
        self.inner = inner
        self._keep = max(len(s) for s in sequences) - 1  # output tokens that can start a match
        self._tail: list[int] = []
        self._dead_end = False  # the last mask allowed nothing but EOS
        self._ended = False

    @property
    def finished(self) -> bool:
        return self._ended or bool(self.inner is not None and self.inner.finished)

    @property
    def rejected(self) -> bool:
        return bool(self.inner is not None and self.inner.rejected)

    def fill(self, row: np.ndarray) -> None:
        if self.inner is not None:
            self.inner.fill(row)
        else:
            row.fill(-1)  # every bit set: every token allowed
        tail = self._tail
        words = row.view(np.uint32)
        for seq in self.sequences:
            prefix = seq[:-1]
            if len(tail) >= len(prefix) and tuple(tail[len(tail) - len(prefix) :]) == prefix:
                token = seq[-1]
                words[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
        self._dead_end = not words.any() and bool(self.eos_token_ids)
        if self._dead_end:
            for token in self.eos_token_ids:
                words[token >> 5] |= np.uint32(1 << (token & 31))

    def accept(self, token: int) -> None:
        if self._dead_end:
            self._ended = True  # EOS, the only token left: the grammar never sees it
            return
        if self.inner is not None:
            self.inner.accept(token)
        self._tail.append(token)
        if len(self._tail) > self._keep:
            del self._tail[: len(self._tail) - self._keep]
