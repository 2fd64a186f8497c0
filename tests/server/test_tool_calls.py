"""Must-show 2 (tools): tool calls through the official openai client against a live server.

The server runs the embedded model (it recites the Zen of Python and never saw a tool call) with an operator's
chat template (--chat-template, Hermes-style, rendering tools and the tool-call history), --enable-auto-tool-choice
and --tool-call-parser hermes.  With tool_choice required or a named function the grammar makes the calls, so
their arguments must validate against the tools' schemas, streamed or not, at temperature 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from engine.server.tool_calls import NO_ARGUMENTS
from tests.server.harness import REPO, free_port, start_server

MODEL = "pagekeeper-default"
TEMPLATE = (
    "{{ bos_token }}{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}"
    "({{ (t.function.parameters or {}).get('required', []) | join(', ') }}){% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}'
    "{% if m.tool_call_id %} [for {{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "minLength": 1, "maxLength": 20},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},  # no parameters: it takes none (OpenAI), so "{}"
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", NO_ARGUMENTS) for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tools")
    template = root / "hermes-ish.jinja"
    template.write_text(TEMPLATE)
    server = start_server(
        root,
        "--max-num-seqs", "8", "--chat-template", str(template),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip
    yield server
    server.kill()


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)


def _validate(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed(client: openai.OpenAI, **kwargs) -> tuple[str, list[tuple[str, str]], str | None, int]:
    """(content, [(name, arguments)], finish_reason, chunks) from a stream, calls rebuilt from their deltas."""
    content, calls, finish, chunks = "", {}, None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        chunks += 1
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert call["id"] is None and d.type == "function" and d.function.name
                call["id"], call["name"] = d.id, d.function.name
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], finish, chunks


def _whole(client: openai.OpenAI, **kwargs) -> tuple[str | None, list[tuple[str, str]], str | None]:
    r = client.chat.completions.create(**kwargs)
    m = r.choices[0].message
    return m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or []], r.choices[0].finish_reason


def test_required_and_named_calls_validate_streamed_and_not(client):
    counts = {"required": 0, "named": 0, "calls": 0, "cut_by_length": 0}
    for seed in range(6):
        common = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=170, temperature=1.0, seed=seed)
        content, calls, finish = _whole(client, tool_choice="required", **common)
        # A model that keeps calling (parallel calls allowed, temperature 1.0) can run out of max_tokens inside a
        # call: then the calls before the cut one must validate, and it may happen to one seed in six at most.
        assert finish in ("tool_calls", "length") and calls and content is None, (content, calls, finish)
        _validate(calls if finish == "tool_calls" else calls[:-1])
        s_content, s_calls, s_finish, chunks = _streamed(client, tool_choice="required", **common)
        assert (s_content, s_calls, s_finish) == ("", calls, finish), "the stream adds up to the reply"
        assert chunks > len(calls) + 2, "arguments arrive in pieces"
        counts["required"] += 1
        counts["cut_by_length"] += finish == "length"
        counts["calls"] += len(calls)

        name = ["get_weather", "add", "now"][seed % 3]
        named = dict(tool_choice={"type": "function", "function": {"name": name}}, **common)
        content, calls, finish = _whole(client, **named)
        assert finish == "stop" and [n for n, _ in calls] == [name], (calls, finish)
        _validate(calls)
        assert _streamed(client, **named)[1:3] == (calls, "stop")
        counts["named"] += 1
    assert counts["cut_by_length"] <= 1, counts
    print(f"{counts}: every call's arguments validate; streams equal the whole replies; e.g. {calls}")


def test_parallel_tool_calls_false_gives_exactly_one_call(client):
    for seed in range(3):
        _, calls, finish = _whole(
            client, model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed,
        )  # fmt: skip
        assert len(calls) == 1 and finish == "tool_calls", calls
        _validate(calls)


def test_auto_reads_the_models_hermes_calls_and_leaves_plain_answers_alone(client):
    """The model cannot write a call by itself, so a regex makes it write one in Hermes' format; the parser
    must find it, and a reply in words must come back as content with no calls."""
    forced = r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>'  # noqa: E501
    common = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=170, temperature=1.0)
    content, calls, finish = _whole(client, extra_body={"guided_regex": forced}, seed=1, **common)
    assert content == "Let me check.\n" and finish == "tool_calls", (content, calls, finish)
    assert [n for n, _ in calls] == ["get_weather"]
    _validate(calls)
    s_content, s_calls, s_finish, _ = _streamed(client, extra_body={"guided_regex": forced}, seed=1, **common)
    assert (s_content, s_calls, s_finish) == (content, calls, finish)

    plain = dict(model=MODEL, messages=[{"role": "user", "content": "Beautiful is"}], tools=TOOLS, max_tokens=12)
    content, calls, finish = _whole(client, temperature=0, **plain)
    assert calls == [] and content and finish in ("stop", "length"), (content, calls)
    assert _streamed(client, temperature=0, **plain)[:3] == (content, [], finish)
    print(f"auto: parsed {calls or s_calls} from the forced reply; a plain answer stays content: {content!r}")


def test_tools_and_the_tool_call_history_reach_the_chat_template(tool_server):
    conversation = [
        {"role": "user", "name": "alice", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    r = httpx.post(tool_server.url + "/tokenize", json={"model": MODEL, "messages": conversation, "tools": TOOLS[:1]})
    assert r.status_code == 200, r.text
    text = httpx.post(tool_server.url + "/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    print(text)
    assert "Tools: get_weather(city, unit)" in text
    assert "user (alice): Weather in Paris?" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "tool: 18 C [for call_1]" in text and text.endswith("assistant:")
    # and the same conversation is answered (the reply is whatever the model makes of it)
    r = httpx.post(
        tool_server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": conversation, "tools": TOOLS, "max_tokens": 4},
    )
    assert r.status_code == 200, r.text


def test_tool_choices_that_cannot_be_honoured_are_a_400_naming_them(tool_server):
    def post(**body) -> httpx.Response:
        return httpx.post(
            tool_server.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body},
            timeout=60,
        )

    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}]
    for body, param in (
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        (dict(tools=bad_schema, tool_choice="required"), "tools"),
        (dict(tools=bad_schema, tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (dict(tools=TOOLS, functions=[{"name": "f"}]), "functions"),
        (
            dict(
                messages=[
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}]}
                ]
            ),
            "messages",
        ),  # noqa: E501
    ):
        r = post(**body)
        err = r.json()["error"]
        print(f"{r.status_code} {err['param']}: {err['message']}")
        assert r.status_code == 400 and err["param"].split(".")[0].split("[")[0] == param, r.text


def _run_server(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.server", "--port", str(free_port()), *args],
        capture_output=True, text=True, timeout=120, cwd=str(REPO),
    )  # fmt: skip


def test_tool_and_template_flag_mistakes_are_a_clear_exit_2(tmp_path: Path):
    r = _run_server("--enable-auto-tool-choice")
    assert r.returncode == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in r.stderr, r.stderr
    r = _run_server("--chat-template", str(tmp_path / "missing.jinja"))
    assert r.returncode == 2 and "--chat-template" in r.stderr and "missing.jinja" in r.stderr, r.stderr
    r = _run_server("--tool-call-parser", "mistral")
    assert r.returncode == 2 and "--tool-call-parser" in r.stderr
    r = _run_server("--generation-config", str(tmp_path))
    assert r.returncode == 2 and "--generation-config" in r.stderr and "generation_config.json" in r.stderr, r.stderr
    print("exit 2 with one line each:", r.stderr.strip().splitlines()[-1])


# -- must-show (issue 37): forced calls over 20 generated schemas, two models, streamed and not -----------------

GENERATED = 20
FORCED_MAX_TOKENS = 48  # small: many replies are cut, and a cut forced reply must still be its call


def _open(schema):  # type: ignore[no-untyped-def]
    """The schema as tools are usually written: no additionalProperties anywhere (JSON Schema then allows any key)."""
    if isinstance(schema, dict):
        return {k: _open(v) for k, v in schema.items() if k != "additionalProperties"}
    if isinstance(schema, list):
        return [_open(v) for v in schema]
    return schema


@pytest.fixture(scope="module", params=["embedded", "random-weights"])
def forced_client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, checkpoint):
    """One server per model for every case: the embedded model, and a random-weight llama checkpoint saved by
    transformers (tests/checkpoints.py), whose next token is anyone's guess."""
    root = tmp_path_factory.mktemp(f"forced-{request.param}")
    model = ("--model", str(checkpoint("llama"))) if request.param == "random-weights" else ()
    server = start_server(root, *model, "--max-num-seqs", "16")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield request.param, client, server
    server.kill()


def test_forced_tool_calls_over_20_generated_schemas_carry_a_call_and_validate(forced_client):
    """Named and required tool_choice over 20 generated schemas (nested objects, enums, arrays, bounded strings and
    integers, optional fields) written without additionalProperties, streamed and not: every reply is a tool call,
    never content; when it finished (tool_calls / stop), its arguments parse and validate against the schema closed
    to the properties it names (what vLLM's default grammar backend generates); when max_tokens cut it (length),
    the call still comes back with its arguments as generated."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.json_schemas import random_schemas

    which, client, server = forced_client
    closed = {f"tool_{i:02d}": s for i, s in enumerate(random_schemas(GENERATED, seed=37))}
    tools = [
        {"type": "function", "function": {"name": name, "description": "generated", "parameters": _open(schema)}}
        for name, schema in closed.items()
    ]
    names = list(closed)
    cases = []
    for i, name in enumerate(names):
        pair = [tools[i], tools[(i + 1) % GENERATED]]  # a second tool, so that required must choose
        for choice in ({"type": "function", "function": {"name": name}}, "required"):
            for stream in (False, True):
                cases.append((name, pair, choice, stream, i))

    def run(case):  # type: ignore[no-untyped-def]
        name, pair, choice, stream, seed = case
        common = dict(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": f"Call {name}."}],
            tools=pair, tool_choice=choice, max_tokens=FORCED_MAX_TOKENS, temperature=1.0, seed=seed,
        )  # fmt: skip
        if stream:
            content, calls, finish, _ = _streamed(client, **common)
        else:
            content, calls, finish = _whole(client, **common)
        return case, content, calls, finish

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, cases))
    finished = cut = 0
    for (name, pair, choice, stream, _), content, calls, finish in results:
        where = f"{which} {name} {choice if isinstance(choice, str) else 'named'} stream={stream}: {content!r} {calls}"
        assert not content and calls, where  # a call, never content
        allowed = [t["function"]["name"] for t in pair]
        assert all(n in allowed for n, _ in calls), where
        if choice != "required":
            assert [n for n, _ in calls] == [name], where
        if finish in ("tool_calls", "stop"):
            assert finish == ("tool_calls" if choice == "required" else "stop"), where
            for n, arguments in calls:
                jsonschema.validate(json.loads(arguments), closed[n])  # no property beyond those named
            finished += 1
        else:
            assert finish == "length", where
            cut += 1
    print(f"{which}: {len(results)} forced replies, {finished} finished and validated, {cut} cut by max_tokens "
          f"{FORCED_MAX_TOKENS} (each still a call); e.g. {[r[2] for r in results[:4]]}")  # fmt: skip
    assert finished >= len(results) // 4, "too few replies finished to show their arguments validate"
    assert server.proc.poll() is None
