"""No request field is ignored: an unknown field, or a known OpenAI/vLLM field at a value pagekeeper
does not implement yet, is a 400 that names it; the same fields at their "off" value are accepted,
because clients send defaults.  Runs against one real server."""

from __future__ import annotations

import httpx
import pytest

from engine.server.protocol import MESSAGE_NOT_YET, NOT_YET

MODEL = "pagekeeper-default"
CHAT_ONLY = {"response_format", "tools", "tool_choice", "functions", "function_call"}
COMPLETION_ONLY = {"suffix"}
ON = {  # a value that asks for the feature
    "logit_bias": {"5": 10},
    "repetition_penalty": 1.2,
    "min_tokens": 4,
    "min_p": 0.1,
    "best_of": 3,
    "response_format": {"type": "json_object"},
    "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "a"',
    "structured_outputs": {"json": {"type": "object"}},
    "bad_words": ["never"],
    "allowed_token_ids": [5, 6],
    "prompt_logprobs": 1,
    "truncate_prompt_tokens": 4,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "required",
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
    off = dict(logit_bias={}, repetition_penalty=1.0, min_tokens=0, min_p=0.0, best_of=1, bad_words=[])
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


def test_message_fields_not_passed_to_the_template_are_refused(shared_server):
    for field, value in (("name", "alice"), ("tool_call_id", "call_1"), ("tool_calls", [{"id": "c"}])):
        assert field in MESSAGE_NOT_YET
        body = _chat(messages=[{"role": "user", "content": "hi", field: value}])
        r = _post(shared_server, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == f"messages[0].{field}", r.text


def test_echo_with_logprobs_is_refused_rather_than_answered_without_prompt_logprobs(shared_server):
    r = _post(shared_server, "/v1/completions", _completion(echo=True, logprobs=1, max_tokens=1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
    assert _post(shared_server, "/v1/completions", _completion(echo=True)).status_code == 200


def test_vllm_output_switches_now_work(shared_server):
    plain = _post(shared_server, "/v1/completions", _completion(stop=["never"])).json()["choices"][0]["text"]
    kept = _post(shared_server, "/v1/completions", _completion(stop=["never"], include_stop_str_in_output=True))
    assert plain == " better than " and kept.json()["choices"][0]["text"] == " better than never"


def test_the_user_field_is_logged_with_the_request_id(shared_server):
    r = _post(shared_server, "/v1/chat/completions", _chat(user="end-user-4711"))
    assert r.status_code == 200, r.text
    lines = [ln for ln in shared_server.log().splitlines() if "request_user" in ln and "end-user-4711" in ln]
    assert lines and r.json()["id"] in lines[0], lines
