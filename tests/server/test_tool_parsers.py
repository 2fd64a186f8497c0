"""The tool-call formats read whole and streamed: a stream cut at every possible point sends content and argument
pieces that add up to exactly what the whole reply gives, and text that is not a call stays content."""

from __future__ import annotations

import json
import random

import pytest

from engine.server import protocol as p
from engine.server.tool_calls import ToolCallStream, ToolPlan, parse_reply
from engine.server.tool_parsers import forced_required_view, hermes_view, llama3_json_view, named_view, required_view

HERMES = (
    "Let me look that up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } and a \\" inside"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"arguments": {"xs": [1, 2.5e3, {"y": null}], "ok": true}, "name": "add"}\n</tool_call>'
)
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "add", "parameters": {"a": 1, "b": -2}}'
REQUIRED = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"add","parameters":{"a":3,"b":4}}]'


def _plan(mode: str, view) -> ToolPlan:  # type: ignore[no-untyped-def]
    return ToolPlan(mode, view=view)


def _stream(plan: ToolPlan, pieces: list[str]) -> tuple[str, dict[int, dict]]:
    """Feed the pieces as a stream does (the last one final); the content sent and the calls rebuilt by index."""
    stream = ToolCallStream(plan)
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, i == len(pieces) - 1)
        content += text
        for d in deltas:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id is not None:
                assert call["id"] is None, "a call's header is sent once"
                call["id"], call["name"] = d.id, d.function.name
            assert call["id"] is not None, "arguments before the header"
            call["arguments"] += d.function.arguments or ""
    return content, calls


def _random_cuts(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize(
    "mode,view,text,names",
    [
        ("auto", hermes_view, HERMES, ["get_weather", "add"]),
        ("auto", llama3_json_view, LLAMA3, ["get_weather", "add"]),
        ("auto", llama3_json_view, "<|python_tag|>" + LLAMA3, ["get_weather", "add"]),
        ("required", required_view, REQUIRED, ["get_weather", "add"]),
        ("named", named_view("add"), '{"a": 1, "b": 2}', ["add"]),
    ],
)
def test_a_stream_cut_anywhere_adds_up_to_the_whole_reply(mode, view, text, names):
    plan = _plan(mode, view)
    whole = parse_reply(plan, text)
    assert [c.function.name for c in whole.tool_calls] == names
    for c in whole.tool_calls:
        assert isinstance(json.loads(c.function.arguments), dict)
    rng = random.Random(0)
    splits = [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]
    splits += [_random_cuts(text, rng) for _ in range(200)]
    for pieces in splits:
        content, calls = _stream(plan, pieces)
        assert content == (whole.content or ""), pieces
        assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [
            (c.function.name, c.function.arguments) for c in whole.tool_calls
        ], pieces
    print(f"{mode} {view.__name__}: {len(splits)} ways of streaming {len(text)} characters agree with the whole")


@pytest.mark.parametrize(
    "view,text",
    [
        (hermes_view, "No tools needed: 2 < 3 and <tool is not a tag."),
        (hermes_view, "<tool_call>not json</tool_call>"),
        (hermes_view, '<tool_call>{"name": "f", "arguments": {"cut": '),  # max_tokens ended it mid-call
        (hermes_view, '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>'),  # arguments must be an object
        (llama3_json_view, "The weather in Paris is mild."),
        (llama3_json_view, '{"no_name": 1}'),
        (llama3_json_view, "   "),
    ],
)
def test_text_that_is_not_a_call_is_all_content(view, text):
    plan = _plan("auto", view)
    whole = parse_reply(plan, text)
    assert whole.tool_calls == [] and whole.content == text
    content, calls = _stream(plan, list(text) if text else [""])
    if not calls:  # a stream that never sent a call header gives back every character as content
        assert content == text
    print(f"{view.__name__} {text!r}: content, no calls")


def test_parallel_tool_calls_false_keeps_the_first_call():
    plan = ToolPlan("auto", view=hermes_view, max_calls=1)
    assert [c.function.name for c in parse_reply(plan, HERMES).tool_calls] == ["get_weather"]
    _, calls = _stream(plan, list(HERMES))
    assert [c["name"] for c in calls.values()] == ["get_weather"]


def test_the_streamed_delta_has_openais_shape():
    stream = ToolCallStream(_plan("named", named_view("add")))
    _, first = stream.feed('{"a"', False)
    _, later = stream.feed(": 1}", True)
    chunk = p.DeltaMessage(tool_calls=first + later).model_dump(exclude_none=True)
    assert chunk["tool_calls"][0] == {
        "index": 0,
        "id": first[0].id,
        "type": "function",
        "function": {"name": "add", "arguments": '{"a"'},
    }
    assert chunk["tool_calls"][1] == {"index": 0, "function": {"arguments": ": 1}"}}
    assert first[0].id.startswith("chatcmpl-tool-")


@pytest.mark.parametrize(
    "mode,view,text,calls",
    [
        # max_tokens cut the arguments: the call comes back with them as generated (vLLM), never as content
        ("named", named_view("get_weather"), '{"city":"SpErIf the', [("get_weather", '{"city":"SpErIf the')]),
        (
            "required",
            forced_required_view(["get_weather", "add"]),
            '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"add","parameters":{"a":3,',
            [("get_weather", '{"city":"Oslo"}'), ("add", '{"a":3,')],
        ),
        # cut inside the name: the grammar allows only the tools, and one starts so
        ("required", forced_required_view(["get_weather", "add"]), '[{"name":"get_w', [("get_weather", "")]),
        # cut before the name began: with one tool there is no other call it can be
        ("required", forced_required_view(["get_weather"]), '[{"na', [("get_weather", "")]),
        ("required", forced_required_view(["get_weather"]), "[", [("get_weather", "")]),
        # two tools and nothing of the name yet: no call can be named, and still no content
        ("required", forced_required_view(["get_weather", "add"]), '[{"name":"', []),
        # a second call cut before its name began is left out
        (
            "required",
            forced_required_view(["get_weather"]),
            '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"',
            [("get_weather", '{"city":"Oslo"}')],
        ),
    ],
)
def test_a_forced_reply_cut_by_max_tokens_is_its_calls_never_content(mode, view, text, calls):
    plan = _plan(mode, view)
    whole = parse_reply(plan, text)
    assert whole.content is None and [(c.function.name, c.function.arguments) for c in whole.tool_calls] == calls
    for i in range(1, len(text)):  # streamed, cut anywhere: the same calls, no content
        content, streamed = _stream(plan, [text[:i], text[i:]])
        assert content == "" and [(streamed[j]["name"], streamed[j]["arguments"]) for j in sorted(streamed)] == calls
    print(f"{mode} {text!r}: {calls}")
