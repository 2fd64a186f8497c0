"""Random JSON schemas of the kinds applications send (objects of typed, bounded fields, enums, arrays,
nesting, optional fields) and a valid instance of each: for the structured-output tests and the
grammar engine benchmark."""

from __future__ import annotations

import random
import string
from typing import Any

_WORDS = ["alpha", "beta", "gamma", "delta", "omega", "red", "green", "blue", "yes", "no", "ok", "error"]


def _field(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.choice([4, 8, 16])}
    if kind == "integer":
        low = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randrange(1, 1000)}
    if kind == "number":
        return {"type": "number"}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randrange(2, 5))}
    if kind == "array":
        items = rng.choice([{"type": "integer"}, {"type": "string", "maxLength": 6}, {"type": "boolean"}])
        return {"type": "array", "items": items, "minItems": 1, "maxItems": rng.randrange(1, 4)}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = rng.sample(
        ["id", "name", "count", "score", "tags", "ok", "kind", "meta", "when", "size"], rng.randrange(1, 5)
    )
    props = {n: _field(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.8] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_schemas(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_object(rng) for _ in range(n)]


def instance_of(schema: dict[str, Any], seed: int = 0) -> Any:
    """One valid instance (for the benchmark's walk; tests validate the model's own output)."""
    rng = random.Random(seed)

    def make(s: dict[str, Any]) -> Any:
        if "enum" in s:
            return rng.choice(s["enum"])
        t = s["type"]
        if t == "string":
            return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randrange(1, s["maxLength"] + 1)))
        if t == "integer":
            return rng.randrange(s.get("minimum", 0), s.get("maximum", 100) + 1)
        if t == "number":
            return round(rng.uniform(-100, 100), 3)
        if t == "boolean":
            return rng.random() < 0.5
        if t == "array":
            return [make(s["items"]) for _ in range(rng.randrange(s["minItems"], s["maxItems"] + 1))]
        return {k: make(v) for k, v in s["properties"].items() if k in s["required"] or rng.random() < 0.5}

    return make(schema)
