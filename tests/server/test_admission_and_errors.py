"""Admission control (429/400), auth, client disconnects, and error shapes; must-show 5's overload."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from engine.default_model import DEFAULT_MODEL_DIR
from tests.server.harness import REPO, free_port

MODEL = "pagekeeper-default"


def test_overload_admits_up_to_max_waiting_and_429s_the_rest(launch):
    max_waiting = 4
    server = launch("--max-num-seqs", "2", "--max-waiting", str(max_waiting))
    body = {"model": MODEL, "prompt": "Now is", "max_tokens": 60, "ignore_eos": True, "temperature": 0}

    async def flood() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(10 * max_waiting)))

    responses = asyncio.run(flood())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) >= max_waiting and refused
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == 60  # every admitted request completed
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "RateLimitError"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    metrics = httpx.get(server.url + "/metrics").text
    assert f'vllm_request_failure_total{{model_name="{MODEL}",reason="rejected"}} {float(len(refused))}' in metrics


def test_requests_that_can_never_fit_are_400s(shared_server):
    long_prompt = "Beautiful is better than ugly. " * 60  # ~300 tokens > max_model_len 256
    r = httpx.post(shared_server.url + "/v1/completions", json={"model": MODEL, "prompt": long_prompt})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(shared_server.url + "/v1/completions", json={"model": MODEL, "prompt": [[1, 2], [3, 10**6]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
        ({"model": MODEL, "prompt": "x", "logprobs": 99}, "logprobs"),
        ({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"model": MODEL, "prompt": []}, "prompt"),
    ],
)
def test_bad_parameters_name_the_parameter(shared_server, body, param):
    r = httpx.post(shared_server.url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == param and err["type"] == "BadRequestError" and err["message"]


def test_a_prompt_longer_than_max_model_len_is_named_whatever_max_tokens_says(shared_server):
    """vLLM names the input (its param is input_tokens): the audit's 1,801-token prompt with max_tokens 4 was
    reported as a max_tokens problem.  Only a prompt that fits with too many max_tokens names max_tokens."""
    long_prompt = "Hello there " * 200
    chat = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 4}
    for path, body, param in (
        ("/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["Now is", long_prompt], "max_tokens": 4}, "prompt[1]"),
        ("/v1/chat/completions", chat, "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": "Now is", "max_tokens": 255}, "max_tokens"),
    ):
        r = httpx.post(shared_server.url + path, json=body, timeout=60)
        err = r.json()["error"]
        print(f"{path} -> {r.status_code} {err['param']}: {err['message']}")
        assert r.status_code == 400 and err["param"] == param, r.text
        assert "maximum context length is 256 tokens" in err["message"]


def test_a_request_without_model_is_served_by_the_served_model(shared_server):
    r = httpx.post(shared_server.url + "/v1/completions", json={"prompt": "Now is", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    chat = {"messages": [{"role": "user", "content": "Now is"}], "max_tokens": 2}
    r = httpx.post(shared_server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text


@pytest.mark.parametrize(
    "raw,param,words",
    [
        ('"max_tokens": "10"', "max_tokens", "valid integer"),
        ('"max_tokens": true', "max_tokens", "valid integer"),
        ('"max_tokens": 2.0', "max_tokens", "valid integer"),
        ('"stream": "yes"', "stream", "valid boolean"),
        ('"echo": 1', "echo", "valid boolean"),
        ('"temperature": NaN', "temperature", "finite number"),
        ('"top_p": Infinity', "top_p", "finite number"),
        ('"seed": "7"', "seed", "valid integer"),
        ('"stop": 5', "stop", ""),
    ],
)
def test_fields_are_strictly_typed_and_nan_is_named(shared_server, raw, param, words):
    """vLLM's lax pydantic turns "10" into 10, true into 1, 2.0 into 2 and "yes" into true; OpenAI's API and
    pagekeeper refuse them (protocol.py).  NaN was refused as "should be less than or equal to 2"."""
    body = '{"model": "%s", "prompt": "Now is", %s}' % (MODEL, raw)
    r = httpx.post(
        shared_server.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    err = r.json()["error"]
    print(f"{raw} -> {r.status_code} {err['message']}")
    assert r.status_code == 400 and err["param"] == param and words in err["message"], r.text


def test_a_float_field_still_takes_an_integer(shared_server):
    body = {"model": MODEL, "prompt": "Now is", "max_tokens": 2, "temperature": 1, "logit_bias": {"5": -100}}
    assert httpx.post(shared_server.url + "/v1/completions", json=body, timeout=60).status_code == 200


@pytest.mark.parametrize(
    "path,body,param,meant",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_token": 5}, "max_token", "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temprature": 0}, "temprature", "temperature"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usag": True}},
            "stream_options.include_usag",
            "include_usage",
        ),
        ("/v1/chat/completions", {"messages": [{"rol": "user", "content": "x"}]}, "messages.0.rol", "role"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}, "frobnicate", None),
    ],
)
def test_an_unknown_field_near_a_known_one_says_which_was_meant(shared_server, path, body, param, meant):
    r = httpx.post(shared_server.url + path, json=body, timeout=60)
    err = r.json()["error"]
    print(f"{body} -> {err['message']}")
    assert r.status_code == 400 and err["param"] == param, r.text
    if meant is None:
        assert err["message"] == f"{param}: unknown field"
    else:
        # (a misspelt role also leaves role missing: "and 1 more problem(s)" follows)
        assert err["message"].startswith(f"{param}: unknown field; did you mean {meant!r}?")


def test_malformed_json_and_unknown_routes(shared_server):
    r = httpx.post(
        shared_server.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = httpx.get(shared_server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_tokenize_detokenize_version_openapi(shared_server):
    url = shared_server.url
    t = httpx.post(url + "/tokenize", json={"prompt": "Beautiful is"}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 256
    d = httpx.post(url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == "Beautiful is"
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 0
    assert httpx.post(url + "/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert httpx.get(url + "/version").json()["version"]
    spec = httpx.get(url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/health", "/metrics", "/drain"} <= set(spec["paths"])


def test_api_key_guards_v1_but_not_health_or_metrics(launch):
    server = launch("--api-key", "s3cret")
    body = {"model": MODEL, "prompt": "Flat is", "max_tokens": 3}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 401
    bad = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "AuthenticationError"
    good = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
    assert good.status_code == 200
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_client_disconnect_aborts_the_request_and_frees_its_blocks(launch):
    server = launch("--enable-debug-hooks")
    body = {"model": MODEL, "prompt": "Errors should", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        for _ in zip(range(3), r.iter_lines()):
            pass
        # the step loop stands still while both clients go away, so that neither request can finish first
        # (a fast CPU generated the 240 tokens before the disconnect was noticed)
        assert httpx.post(server.url + "/debug/freeze", params={"seconds": 2}).status_code == 200
    # closed after a few chunks; a non-streaming request cut off by a client timeout too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
    # The gauges come from the engine core's next report (its own process by default): all three, within 10 s.
    want = (
        f'vllm_request_success_total{{finished_reason="abort",model_name="{MODEL}"}} 2.0',
        f'vllm_gpu_cache_usage_perc{{model_name="{MODEL}"}} 0.0',
        f'vllm_num_requests_running{{model_name="{MODEL}"}} 0.0',
    )
    deadline = time.monotonic() + 10
    metrics = ""
    while time.monotonic() < deadline:
        metrics = httpx.get(server.url + "/metrics").text
        if all(w in metrics for w in want):
            break
        time.sleep(0.1)
    assert f'vllm_request_success_total{{finished_reason="abort",model_name="{MODEL}"}} 2.0' in metrics
    assert f'vllm_gpu_cache_usage_perc{{model_name="{MODEL}"}} 0.0' in metrics
    assert f'vllm_num_requests_running{{model_name="{MODEL}"}} 0.0' in metrics


def _seed_script_args(tp: int, port: int) -> list[str]:
    """The flags of the seed's production start-up script, with only the model path changed."""
    return [
        "--model",
        str(DEFAULT_MODEL_DIR),
        "--tensor-parallel-size",
        str(tp),
        "--port",
        str(port),
        "--host",
        "0.0.0.0",
        "--gpu-memory-utilization",
        "0.88",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        "24576",
        "--block-size",
        "16",
        "--swap-space",
        "8",
        "--disable-log-requests",
        "--enable-chunked-prefill",
        "--max-num-on-the-fly-batches",
        "4",
        "--dtype",
        "bfloat16",
        "--trust-remote-code",
    ]


def _run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "engine.server", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(REPO),
    )


def test_seed_startup_script_flags_start_the_server(launch):
    port = free_port()
    args = _seed_script_args(1, port)
    args.remove("--port")
    args.remove(str(port))
    server = launch(*args, port=port)
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": str(DEFAULT_MODEL_DIR), "prompt": "Now is", "max_tokens": 8, "temperature": 0},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " better than never."
    assert "flag_ignored_on_cpu" in server.log() and "swap-space" in server.log()


def test_a_tensor_parallel_size_the_heads_do_not_split_over_is_a_clear_exit_2():
    r = _run(_seed_script_args(3, free_port()))
    assert r.returncode == 2
    assert "--tensor-parallel-size 3 does not divide the model's 4 attention heads; use one of 1, 2, 4" in r.stderr
    assert "engine.distributed.worker" not in r.stderr  # refused before any worker started


def test_a_taken_port_is_a_clear_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = _run(["--port", str(s.getsockname()[1])])
    assert r.returncode == 2
    assert "cannot listen on 127.0.0.1" in r.stderr and "--port" in r.stderr
    assert f"(held by pid {os.getpid()}: " in r.stderr  # who holds it: here, this test


def test_a_malformed_or_foreign_host_is_a_clear_exit_2_naming_the_host():
    r = _run(["--host", "999.1.1.1", "--port", str(free_port())])
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert '--host "999.1.1.1": not an IPv4 or IPv6 address or a host name' in r.stderr
    port = free_port()
    r = _run(["--host", "192.0.2.1", "--port", str(port)])  # TEST-NET-1: well formed, never this machine's
    print(r.stderr.strip())
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"cannot listen on 192.0.2.1:{port}" in r.stderr and r.stderr.strip().endswith("; use --host")


def test_a_max_model_len_that_cannot_fit_is_a_clear_exit_2():
    r = _run(["--kv-cache-memory-bytes", "65536", "--max-model-len", "256"])
    assert r.returncode == 2 and "--max-model-len" in r.stderr
