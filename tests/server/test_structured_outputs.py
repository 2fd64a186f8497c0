"""Must-show 2: structured outputs through the official openai client against a live server.

The embedded model is tiny and was never trained on JSON (it recites the Zen of Python), so every
valid JSON document, regex match and choice here is the grammar's doing.  Sampling is random
(temperature 1) so the outputs vary; the grammar must hold every time.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.json_schemas import random_schemas

MODEL = "pagekeeper-default"


@pytest.fixture(scope="module")
def client(shared_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(shared_server) -> openai.AsyncOpenAI:
    """One per test: an async client belongs to the event loop of the test's asyncio.run."""
    return openai.AsyncOpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0)


def _messages(text: str = "Describe one thing as JSON.") -> list[dict]:
    return [{"role": "user", "content": text}]


def test_json_schema_responses_validate_for_20_generated_schemas(aclient):
    schemas = random_schemas(20, seed=5)

    async def one(i: int, schema: dict) -> tuple[str, str]:
        r = await aclient.chat.completions.create(
            model=MODEL,
            messages=_messages(),
            max_tokens=220,
            temperature=1.0,
            seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}},
        )
        return r.choices[0].message.content or "", r.choices[0].finish_reason

    async def run() -> list[tuple[str, str]]:
        return await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas)))

    results = asyncio.run(run())
    valid = 0
    for schema, (text, finish) in zip(schemas, results):
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), schema)
        valid += 1
    print(f"{valid}/{len(schemas)} generated schemas: responses parse and validate; e.g. {results[0][0]}")
    assert valid == 20


def test_guided_choice_regex_grammar_and_json_object(client):
    choices = ["red", "green", "blue"]
    got_choices, got_regex = set(), []
    for seed in range(6):
        r = client.completions.create(
            model=MODEL, prompt="Errors should", max_tokens=30, temperature=1.0, seed=seed,
            extra_body={"guided_choice": choices},
        )  # fmt: skip
        got_choices.add(r.choices[0].text)
        r = client.completions.create(
            model=MODEL, prompt="Now is", max_tokens=30, temperature=1.0, seed=seed,
            extra_body={"guided_regex": r"[a-z]{2,5}-[0-9]{3}"},
        )  # fmt: skip
        got_regex.append(r.choices[0].text)
    print(f"guided_choice gave {sorted(got_choices)}; guided_regex gave {got_regex}")
    assert got_choices <= set(choices)
    assert all(re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t) for t in got_regex)
    r = client.completions.create(
        model=MODEL, prompt="Now is", max_tokens=30, temperature=1.0,
        extra_body={"guided_grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/'},
    )  # fmt: skip
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", r.choices[0].text), r.choices[0].text
    # Any JSON object: a model that never learned JSON may also wander inside a string until max_tokens.
    r = client.chat.completions.create(
        model=MODEL, messages=_messages(), max_tokens=200, temperature=1.0, seed=2, n=8,
        response_format={"type": "json_object"},
    )  # fmt: skip
    done = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    print(f"json_object: {len(done)} of 8 complete: {done}")
    assert done and all(isinstance(json.loads(t), dict) for t in done)
    assert all(c.message.content.startswith("{") for c in r.choices)
    r = client.completions.create(
        model=MODEL, prompt="Now is", max_tokens=60, temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
    )  # fmt: skip
    assert r.choices[0].text in ("alpha", "beta")


def test_streamed_json_schema_output_validates(client):
    schema = random_schemas(1, seed=9)[0]
    stream = client.chat.completions.create(
        model=MODEL, messages=_messages(), max_tokens=220, temperature=1.0, seed=4, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )  # fmt: skip
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    text = "".join(parts)
    print(f"{len(parts)} chunks: {text}")
    jsonschema.validate(json.loads(text), schema)


KEY_ONLY = {
    "type": "object",
    "properties": {"k": {"type": "integer"}},
    "required": ["k"],
    "additionalProperties": False,
}


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(aclient):
    """Constrained sequences make the core read every step before the next: the others' greedy
    outputs must be the same as when they run alone."""
    prompts = ["Beautiful is", "Flat is", "Sparse is", "Now is"]

    async def plain(p: str) -> str:
        r = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0)
        return r.choices[0].text

    async def constrained(i: int) -> str:
        r = await aclient.completions.create(
            model=MODEL, prompt="Now is", max_tokens=200, temperature=1.0, seed=i,
            extra_body={"guided_json": KEY_ONLY},
        )  # fmt: skip
        return r.choices[0].text

    async def run() -> tuple[list[str], list[str], list[str]]:
        alone = [await plain(p) for p in prompts]
        mixed = await asyncio.gather(*(plain(p) for p in prompts), *(constrained(i) for i in range(4)))
        return alone, list(mixed[:4]), list(mixed[4:])

    alone, beside, json_texts = asyncio.run(run())
    print(f"alone == beside constrained: {alone == beside}; constrained: {json_texts}")
    assert alone == beside
    assert all(isinstance(json.loads(t)["k"], int) for t in json_texts)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"guided_json": '{"type": "object", "properties": '}, "guided_json"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_grammar": "start: foo("}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a+", "whitespace": True}}, "structured_outputs"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_a_constraint_that_cannot_be_compiled_is_a_400_naming_its_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Now is", max_tokens=8, extra_body=extra)
    err = e.value.body
    print(f"{extra}: {e.value.status_code} {err}")
    assert e.value.status_code == 400 and err["param"].split(".")[0] == param, err
