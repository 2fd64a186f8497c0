"""No request field is ignored: an unknown field, or a known OpenAI/vLLM field at a value pagekeeper
does not implement yet, is a 400 that names it; the same fields at their "off" value are accepted,
because clients send defaults.  Runs against one real server."""

from __future__ import annotations

import httpx
import pytest

from engine.server.protocol import NOT_YET

MODEL = "pagekeeper-default"
CHAT_ONLY = {"functions", "function_call"}
COMPLETION_ONLY = {"suffix"}
ON = {  # a value that asks for the feature
    "best_of": 3,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "suffix": "!",
}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _completion(**extra) -> dict:
    return {"model": MODEL, "prompt": "Now is", "max_tokens": 8, "temperature": 0, **extra}


def _chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Now is"}], "max_tokens": 8, **extra}


def test_every_not_yet_field_is_listed_with_a_value_that_turns_it_on():
    assert set(ON) == set(NOT_YET)


@pytest.mark.parametrize("field", sorted(NOT_YET))
def test_a_feature_not_built_yet_is_a_400_naming_it(shared_server, field):
    paths = []
    if field not in CHAT_ONLY:
        paths.append(("/v1/completions", _completion(**{field: ON[field]})))
    if field not in COMPLETION_ONLY:
        paths.append(("/v1/chat/completions", _chat(**{field: ON[field]})))
    for path, body in paths:
        r = _post(shared_server, path, body)
        err = r.json()["error"]
        print(f"{path} {field}={ON[field]!r}: {r.status_code} {err['message']}")
        assert r.status_code == 400 and err["param"] == field and field in err["message"], r.text


def test_the_off_values_clients_send_by_default_are_accepted(shared_server):
    off = dict(best_of=1, bad_words=[])
    r = _post(shared_server, "/v1/completions", _completion(suffix=None, use_beam_search=False, **off))
    assert r.status_code == 200, r.text
    chat = _chat(response_format={"type": "text"}, tools=[], tool_choice="auto", parallel_tool_calls=True, **off)
    r = _post(shared_server, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    r = _post(shared_server, "/v1/completions", _completion(n=2, best_of=2))  # best_of == n: nothing to choose
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_unknown_fields_anywhere_are_a_400_naming_them(shared_server):
    for path, body, where in (
        ("/v1/completions", _completion(frobnicate=1), "frobnicate"),
        ("/v1/chat/completions", _chat(temprature=0.5), "temprature"),
        ("/v1/chat/completions", _chat(stream=True, stream_options={"include_usage": True, "x": 1}), "x"),
        ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "hi", "lang": "en"}]), "lang"),
        ("/tokenize", {"model": MODEL, "prompt": "hi", "shout": True}, "shout"),
    ):
        r = _post(shared_server, path, body)
        assert r.status_code == 400 and where in r.json()["error"]["message"], (path, r.text)


def test_tool_fields_that_the_server_cannot_honour_are_a_400_naming_them(shared_server):
    """This server has no --tool-call-parser: "auto" (the default with tools) would return calls as text."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for body, param in (
        (_chat(tools=[tool]), "tool_choice"),
        (_chat(tools=[tool], tool_choice="auto"), "tool_choice"),
        (_chat(tool_choice="required"), "tool_choice"),
        (_chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
        (_chat(tools=[tool, tool], tool_choice="required"), "tools"),
        (_chat(tools=[{"type": "function", "function": {"name": "has space"}}], tool_choice="none"), "tools"),
        (_chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c"}]}]), "messages"),
    ):
        r = _post(shared_server, "/v1/chat/completions", body)
        err = r.json()["error"]
        print(f"{r.status_code} {err['param']}: {err['message']}")
        assert r.status_code == 400 and err["param"].split("[")[0].split(".")[0] == param, r.text
    r = _post(shared_server, "/v1/chat/completions", _chat(tools=[tool], tool_choice="none"))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == [], r.text


def test_prompt_logprobs_are_not_streamed_and_say_so(shared_server):
    for path, body in (
        ("/v1/completions", _completion(echo=True, logprobs=1, stream=True)),
        ("/v1/completions", _completion(prompt_logprobs=1, stream=True)),
        ("/v1/chat/completions", _chat(prompt_logprobs=0, stream=True)),
    ):
        r = _post(shared_server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("echo", "prompt_logprobs"), r.text


def test_vllm_output_switches_now_work(shared_server):
    plain = _post(shared_server, "/v1/completions", _completion(stop=["never"])).json()["choices"][0]["text"]
    kept = _post(shared_server, "/v1/completions", _completion(stop=["never"], include_stop_str_in_output=True))
    assert plain == " better than " and kept.json()["choices"][0]["text"] == " better than never"


def test_the_user_field_is_logged_with_the_request_id(shared_server):
    r = _post(shared_server, "/v1/chat/completions", _chat(user="end-user-4711"))
    assert r.status_code == 200, r.text
    lines = [ln for ln in shared_server.log().splitlines() if "request_user" in ln and "end-user-4711" in ln]
    assert lines and r.json()["id"] in lines[0], lines


def test_vllm_sampling_adjustments_are_applied(shared_server):
    """Each adjustment changes what a greedy request returns, the way vLLM defines it (the exact
    values are checked against a reference in tests/engine/test_logits_adjust.py)."""

    def run(**extra) -> dict:
        r = _post(shared_server, "/v1/completions", _completion(**{"max_tokens": 8, **extra}))
        assert r.status_code == 200, r.text
        return r.json()

    def text(**extra) -> str:
        return run(**extra)["choices"][0]["text"]

    plain = text()
    token = httpx.post(shared_server.url + "/tokenize", json={"prompt": " time", "add_special_tokens": False})
    tid = token.json()["tokens"][-1]
    piece = httpx.post(shared_server.url + "/detokenize", json={"tokens": [tid]}).json()["prompt"]
    biased = {"logit_bias": {str(tid): 14}}  # enough to repeat the token, not enough to beat penalties
    effects = {
        "logit_bias": text(logit_bias={str(tid): 100}),
        "allowed_token_ids": text(allowed_token_ids=[tid], temperature=1.0),
        "repetition_penalty": text(prompt="Errors should never pass silently. Errors should", repetition_penalty=5.0),
        "frequency_penalty": text(**biased, frequency_penalty=1.0),
        "presence_penalty": text(**biased, frequency_penalty=1.0, presence_penalty=2.0),
        "min_p": text(temperature=1.0, min_p=1.0, seed=3),
    }
    for name, value in effects.items():
        print(f"{name}: {value!r} (plain: {plain!r})")
    assert effects["logit_bias"] == effects["allowed_token_ids"] == piece * 8
    assert effects["repetition_penalty"] != text(prompt="Errors should never pass silently. Errors should")
    assert text(**biased) == piece * 8
    assert effects["frequency_penalty"] != piece * 8  # each repeat costs 1 more
    assert effects["presence_penalty"] not in (piece * 8, effects["frequency_penalty"])  # 2 more, from the first
    assert effects["min_p"] == plain  # min_p 1 keeps only the most likely token
    first = run()["choices"][0]
    stop = httpx.post(shared_server.url + "/tokenize", json={"prompt": first["text"], "add_special_tokens": False})
    stop_id = stop.json()["tokens"][0]
    early = run(stop_token_ids=[stop_id])
    held = run(stop_token_ids=[stop_id], min_tokens=5)
    print(
        f"stop_token_ids=[{stop_id}]: {early['usage']['completion_tokens']} tokens; with min_tokens 5: "
        f"{held['usage']['completion_tokens']}"
    )
    assert early["usage"]["completion_tokens"] == 1 and held["usage"]["completion_tokens"] >= 5


def test_bad_adjustment_values_are_a_400_naming_them(shared_server):
    for field, value in (
        ("logit_bias", {"not-a-token": 1}),
        ("logit_bias", {"5": 500}),
        ("logit_bias", {"99999999": 1}),
        ("allowed_token_ids", [99999999]),
        ("repetition_penalty", 0),
        ("min_p", 2),
        ("min_tokens", -1),
        ("presence_penalty", 3),
    ):
        r = _post(shared_server, "/v1/completions", _completion(**{field: value}))
        err = r.json()["error"]
        print(f"{field}={value!r}: {r.status_code} {err['message']}")
        assert r.status_code == 400 and err["param"].split(".")[0] == field, r.text
    r = _post(shared_server, "/v1/completions", _completion(min_tokens=9, max_tokens=8))
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_truncate_prompt_tokens_keeps_the_last_tokens(shared_server):
    long = "Errors should never pass silently. Unless explicitly silenced. Now is"
    ids = httpx.post(shared_server.url + "/tokenize", json={"prompt": long}).json()["tokens"]
    tail = httpx.post(shared_server.url + "/detokenize", json={"tokens": ids[-6:]}).json()["prompt"]
    cut = _post(shared_server, "/v1/completions", _completion(prompt=long, truncate_prompt_tokens=6, echo=True)).json()
    same = _post(shared_server, "/v1/completions", _completion(prompt=ids[-6:])).json()
    print(f"{len(ids)} prompt tokens cut to {cut['usage']['prompt_tokens']}: echo {cut['choices'][0]['text']!r}")
    assert cut["usage"]["prompt_tokens"] == 6
    assert cut["choices"][0]["text"] == tail + same["choices"][0]["text"]


def test_bad_words_are_never_generated(shared_server):
    plain = _post(shared_server, "/v1/completions", _completion(prompt="Beautiful is")).json()["choices"][0]["text"]
    body = _completion(prompt="Beautiful is", bad_words=["better", "than ugly"])
    text = _post(shared_server, "/v1/completions", body).json()["choices"][0]["text"]
    print(f"{plain!r} with bad_words: {text!r}")
    assert "better" in plain and "better" not in text and "than ugly" not in text
    r = _post(shared_server, "/v1/completions", _completion(bad_words=[""]))
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("bad_words"), r.text
