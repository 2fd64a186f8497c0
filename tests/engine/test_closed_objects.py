"""JSON schemas are compiled with their objects closed to the properties they name (engine/structured_output.py):
the audit's forced get_weather call wrote key after key until max_tokens, because JSON Schema's own default
admits any extra property.  vLLM's default grammar backend (xgrammar, strict mode) closes them the same way."""

from __future__ import annotations

import numpy as np
from transformers import AutoTokenizer

from engine.default_model import DEFAULT_MODEL_DIR
from engine.sampling_params import StructuredOutputsParams
from engine.structured_output import GrammarCompiler, close_objects

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "extra": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
        "free": {"type": "object"},
    },
    "required": ["city"],
    "$defs": {"p": {"type": "object", "properties": {"q": {"type": "string"}}}},
}


def test_every_object_that_names_its_properties_is_closed_unless_it_says_otherwise():
    closed = close_objects(WEATHER)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["where"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["extra"]["additionalProperties"] is True  # the schema said so
    assert "additionalProperties" not in props["free"]  # names nothing: any object, as json_object
    assert closed["$defs"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in WEATHER  # a copy: the request's schema is left as it came


def _accepts(compiler: GrammarCompiler, tokenizer, schema: dict, text: str) -> bool:  # type: ignore[no-untyped-def]
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(json=schema)))
    row = np.zeros(compiler.mask_words, dtype=np.int32)
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        matcher.fill(row)
        if not (int(row[token // 32]) >> (token % 32)) & 1:
            return False
        matcher.accept(token)
    return not matcher.rejected


def test_the_grammar_refuses_a_key_the_schema_does_not_name():
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    eos = frozenset([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else frozenset()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), eos)
    assert _accepts(compiler, tokenizer, WEATHER, '{"city":"Paris","where":{"lat":1.5}}')
    assert not _accepts(compiler, tokenizer, WEATHER, '{"city":"Paris","ood":1}')
    assert not _accepts(compiler, tokenizer, WEATHER, '{"city":"Paris","where":{"lat":1,"lon":2}}')
    assert _accepts(compiler, tokenizer, WEATHER, '{"city":"Paris","extra":{"a":1,"b":2}}')  # it allows more
    assert _accepts(compiler, tokenizer, WEATHER, '{"city":"Paris","free":{"anything":true}}')
