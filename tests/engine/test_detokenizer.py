"""Incremental detokenization equals decoding the whole output, including split UTF-8 characters."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from engine.core.detokenizer import IncrementalDetokenizer
from engine.default_model import DEFAULT_MODEL_DIR


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))


@pytest.mark.parametrize("text", ["Beautiful is better than ugly.", "naïve café — 東京 🚀 done", "a\n\nb  c"])
def test_incremental_text_equals_full_decode(tok, text):
    prompt = tok("Flat is")["input_ids"]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, prompt)
    for i in ids:
        assert d.add_token(i) is None
        assert "\ufffd" not in d.text  # never shows half a character
    assert d.text == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) == text


def test_random_token_streams_match_full_decode(tok):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(4, len(tok)) for _ in range(rng.randrange(1, 60))]
        d = IncrementalDetokenizer(tok, [1])
        for i in ids:
            d.add_token(i)
        full = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert full.startswith(d.text) and len(full) - len(d.text) <= 3  # only an unfinished char held back


def test_stop_string_spanning_tokens_truncates(tok):
    ids = tok(" better than ugly.", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, [1], stop_strings=("han ug",))
    hits = [d.add_token(i) for i in ids]
    assert "han ug" in hits and d.text == " better t"
    d = IncrementalDetokenizer(tok, [1], stop_strings=("han ug",), include_stop_str_in_output=True)
    for i in ids:
        if d.add_token(i):
            break
    assert d.text == " better than ug"
