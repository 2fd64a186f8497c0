"""Must-show 1: the official openai client against a live server on the embedded model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine.default_model import DEFAULT_MODEL_DIR

MODEL = "pagekeeper-default"
ZEN = {z["prefix"]: z["completion"] for z in json.loads((DEFAULT_MODEL_DIR / "zen_prefixes.json").read_text())}


@pytest.fixture(scope="module")
def client(shared_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    # the checkpoint's path on the server's disk is not revealed (neither here nor in the OpenAPI spec)
    assert str(DEFAULT_MODEL_DIR) not in client.models.list().model_dump_json()
    assert str(DEFAULT_MODEL_DIR) not in httpx.get(str(client.base_url).replace("/v1/", "/openapi.json")).text


def test_completion_with_usage(client):
    r = client.completions.create(model=MODEL, prompt="Beautiful is", max_tokens=20, temperature=0)
    assert r.choices[0].text == ZEN["Beautiful is"]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_batch_of_prompts_and_n(client):
    prompts = ["Flat is", "Sparse is"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=20, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [ZEN["Flat is"]] * 2 + [ZEN["Sparse is"]] * 2
    sampled = client.completions.create(
        model=MODEL, prompt="Simple is", max_tokens=8, temperature=2.0, n=2, seed=5, extra_body={"ignore_eos": True}
    )
    assert len(sampled.choices) == 2 and sampled.usage.completion_tokens == 16


def test_stop_strings(client):
    r = client.completions.create(model=MODEL, prompt="Beautiful is", max_tokens=20, temperature=0, stop=[" than"])
    assert r.choices[0].text == " better"
    assert r.choices[0].finish_reason == "stop"


def test_streaming_completion_reassembles_to_the_full_text(client):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Explicit is",
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ZEN["Explicit is"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_streaming_with_a_stop_string_never_shows_the_cut_text(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Beautiful is", max_tokens=20, temperature=0, stream=True, stop=" ugly"
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == " better than"


def test_chat_completion(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Now is"}], temperature=0, max_tokens=20
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ZEN["Now is"]
    assert r.usage.completion_tokens > 0


def test_streaming_chat_with_n_and_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Flat is"}],
        temperature=0,
        max_tokens=20,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert texts == {0: ZEN["Flat is"], 1: ZEN["Flat is"]}
    assert usage.completion_tokens == 2 * usage.completion_tokens // 2 > 0


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Readability", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    c = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Readability"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 2 for e in content)


def test_errors_are_openai_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=7)
    assert e.value.body["param"] == "temperature"
