"""vLLM's server flags that change behaviour beyond the request: --generation-config, --disable-log-stats,
--uvicorn-log-level.  Each is shown doing what it says on a real server (and offline, where it applies)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.default_model import DEFAULT_MODEL_DIR
from tests.server.harness import start_server

GENERATION_DEFAULTS = {
    "temperature": 0.0,
    "top_k": 5,
    "repetition_penalty": 1.0,
    "max_new_tokens": 7,
    "do_sample": True,
}


@pytest.fixture(scope="module")
def recommended(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model with a generation_config.json that recommends greedy decoding and 7 new tokens."""
    root = tmp_path_factory.mktemp("gen") / "zen-greedy"
    shutil.copytree(DEFAULT_MODEL_DIR, root, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **GENERATION_DEFAULTS}))
    return root


def test_offline_defaults_follow_the_checkpoint_unless_told_not_to(recommended: Path):
    with LLM(model=str(recommended)) as llm:
        params = llm.get_default_sampling_params()
        assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 5, 7)
        out = llm.generate(["Beautiful is"] * 3, use_tqdm=False)  # no SamplingParams: the checkpoint's
        texts = {o.outputs[0].text for o in out}
        assert len(texts) == 1 and len(out[0].outputs[0].token_ids) <= 7, texts
        explicit = llm.generate(["Beautiful is"], SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)
        assert explicit[0].outputs[0].text in texts
    with LLM(model=str(recommended), generation_config="vllm") as llm:
        params = llm.get_default_sampling_params()
        assert (params.temperature, params.top_k, params.max_tokens) == (1.0, 0, 16)
    print(f"generation_config auto: {GENERATION_DEFAULTS}; greedy replies {texts}")


def test_served_requests_take_the_checkpoints_defaults_for_fields_they_leave_out(launch, recommended: Path):
    server = launch("--model", str(recommended))
    chat = {"model": "zen-greedy", "messages": [{"role": "user", "content": "Now is"}], "ignore_eos": True}
    replies = [httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json() for _ in range(3)]
    texts = {r["choices"][0]["message"]["content"] for r in replies}
    assert len(texts) == 1, texts  # temperature 0 from the checkpoint
    assert [r["usage"]["completion_tokens"] for r in replies] == [7, 7, 7]  # its max_new_tokens
    hot = httpx.post(server.url + "/v1/chat/completions", json={**chat, "temperature": 1.5, "max_tokens": 30}).json()
    assert hot["usage"]["completion_tokens"] == 30  # a field the request sets wins
    print(f"served defaults: {texts.pop()!r} x3 with 7 tokens each")


def test_stats_lines_are_logged_while_there_is_work_and_not_with_disable_log_stats(launch):
    env = {"PAGEKEEPER_LOG_STATS_INTERVAL": "0.3"}
    body = {"model": "pagekeeper-default", "prompt": "Now is", "max_tokens": 200, "ignore_eos": True}
    counts = {}
    for flags in ((), ("--disable-log-stats",)):
        server = launch(*flags, env=env)
        started = time.monotonic()
        while time.monotonic() - started < 1.5:  # keep the engine busy for several stats intervals
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        time.sleep(0.5)
        lines = [json.loads(ln) for ln in server.log().splitlines() if '"engine_stats"' in ln]
        counts[flags] = len(lines)
        if lines:
            line = lines[0]
            assert line["avg_generation_throughput"] > 0 and "kv_cache_usage_perc" in line, line
    print(f"stats lines: {counts[()]} by default, {counts[('--disable-log-stats',)]} with --disable-log-stats")
    assert counts[()] >= 1 and counts[("--disable-log-stats",)] == 0


@pytest.fixture(scope="module")
def chatty(tmp_path_factory: pytest.TempPathFactory):
    """A server with `--uvicorn-log-level info`, for the two tests below that read its log (the second stops it)."""
    server = start_server(tmp_path_factory.mktemp("chatty"), "--uvicorn-log-level", "info")
    yield server
    server.kill()


def test_uvicorn_log_level_reaches_uvicorn(launch, chatty):
    quiet = launch()
    for server in (quiet, chatty):
        httpx.get(server.url + "/health")
    assert "Uvicorn running" not in quiet.log() and "Started server process" not in quiet.log()
    assert "Started server process" in chatty.log() or "Uvicorn running" in chatty.log(), chatty.log()[-2000:]


def test_disable_fastapi_docs_leaves_no_docs_and_the_key_guards_only_the_api(launch, tmp_path: Path):
    """With an API key, /docs, /redoc and /openapi.json still answered anyone; --disable-fastapi-docs (vLLM's flag;
    `[engine] disable_fastapi_docs` in the TOML file) removes them.  What stays open without the key is what
    probes and scrapers need: /health, /metrics, /version (docs/operations.md, "Auth")."""
    config = tmp_path / "docs.toml"
    config.write_text("[engine]\ndisable_fastapi_docs = true\n")
    env = {"PAGEKEEPER_API_KEY": "sk-docs-test"}
    default, disabled = launch(env=env), launch("--config", str(config), env=env)
    docs = ("/docs", "/redoc", "/openapi.json")
    assert [httpx.get(default.url + path).status_code for path in docs] == [200, 200, 200]
    assert [httpx.get(disabled.url + path).status_code for path in docs] == [404, 404, 404]
    for server in (default, disabled):
        assert [httpx.get(server.url + path).status_code for path in ("/health", "/metrics", "/version")] == [200] * 3
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    ok = httpx.get(disabled.url + "/v1/models", headers={"Authorization": "Bearer sk-docs-test"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "pagekeeper-default"


def test_every_line_of_the_engines_log_is_json(chatty):
    """A log collector reads JSON lines: transformers' warning about a prompt past the tokenizer's length and
    uvicorn's about a malformed request were plain lines among them.  Stops the shared server, whose whole log it
    reads (the test above sent it a request too)."""
    import socket

    server = chatty
    body = {"model": "pagekeeper-default", "prompt": "Hello there " * 200, "max_tokens": 4}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 400
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        s.recv(1024)
    assert httpx.get(server.url + "/health").status_code == 200
    server.terminate()
    lines = [ln for ln in server.log().splitlines() if ln.strip()]
    plain = [ln for ln in lines if not ln.startswith("{")]
    events = [json.loads(ln) for ln in lines if ln.startswith("{")]
    print(f"{len(lines)} lines, plain: {plain}; uvicorn's: {[e['event'] for e in events if e.get('logger')]}")
    assert not plain
    assert any("Invalid HTTP request" in e["event"] and e["logger"] == "uvicorn.error" for e in events)
    assert any("Started server process" in e["event"] for e in events)  # --uvicorn-log-level info still reaches it
