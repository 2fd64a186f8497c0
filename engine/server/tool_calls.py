"""Tool calling for /v1/chat/completions: what a request's tools and tool_choice ask of the model, and its reply
turned into OpenAI's `tool_calls`, whole or streamed.

- `none`: the tools are shown to the chat template, the reply is text.
- `auto`: the model decides; its reply is read by the server's `--tool-call-parser` (engine/server/tool_parsers.py).
  Like vLLM, it needs `--enable-auto-tool-choice`: a model whose format the server does not know would otherwise
  have its calls returned as plain text, silently.
- `required` and a named function: the reply is constrained (structured outputs, the same llguidance masks as
  `response_format`) to a JSON array of calls to the given tools, or to the named function's arguments, so the
  arguments always validate against the function's schema, whatever the model.  The reply is always the calls,
  never content: one that max_tokens cut carries its calls with the arguments as generated (finish_reason
  "length"), as vLLM's does; a client checks finish_reason before it parses them.  The schema's objects admit no
  properties beyond those they name unless they say `additionalProperties`, as vLLM's default grammar backend
  (engine/structured_output.py, `close_objects`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.sampling_params import StructuredOutputsParams
from engine.server import protocol as p
from engine.server.errors import OpenAIError
from engine.server.tool_parsers import PARSERS, ScannedCall, View, final_calls, forced_required_view, named_view

FORCED = ("required", "named")  # the grammar makes the model call: the reply is its calls, whatever cut it
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# OpenAI: "omitting parameters defines a function with an empty parameter list"
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    template_tools: list[dict[str, Any]] | None = None  # what the chat template is given
    constraint: StructuredOutputsParams | None = None  # required / named
    view: Callable[[str, bool], View] | None = None  # reads the reply (None: plain text)
    max_calls: int = 128

    @property
    def reads_calls(self) -> bool:
        return self.view is not None


def plan_tools(body: p.ChatCompletionRequest, parser: str | None, auto_enabled: bool) -> ToolPlan:
    """The request's tools and tool_choice, checked; a choice the server cannot honour is a 400 naming it."""
    tools = body.tools or []
    names = [t.function.name for t in tools]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise OpenAIError(400, f"tools defines {duplicated[0]!r} more than once", param="tools")
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    template_tools = [t.model_dump(exclude_none=True) for t in tools] or None
    max_calls = 1 if body.parallel_tool_calls is False else 128
    if not tools:
        if choice in ("none", "auto"):
            return ToolPlan("none")
        raise OpenAIError(400, f"tool_choice {_shown(choice)} needs tools to choose from", param="tool_choice")
    if choice == "none":
        return ToolPlan("none", template_tools)
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise OpenAIError(
                400,
                'tool_choice "auto" (the default when tools are given) needs the server started with '
                "--enable-auto-tool-choice and --tool-call-parser; or send tool_choice required, none or "
                "a named function",
                param="tool_choice",
            )
        return ToolPlan("auto", template_tools, view=PARSERS[parser], max_calls=max_calls)
    if choice == "required":
        schema = _required_schema(tools, max_calls)
        return ToolPlan(
            "required",
            template_tools,
            StructuredOutputsParams(json=schema, param="tools"),
            forced_required_view(names),
            max_calls,
        )
    assert isinstance(choice, p.NamedToolChoice)
    wanted = choice.function.name
    if wanted not in names:
        raise OpenAIError(
            400, f"tool_choice names {wanted!r}, which is not among the tools ({', '.join(names)})", param="tool_choice"
        )
    function = tools[names.index(wanted)].function
    return ToolPlan(
        "named",
        template_tools,
        StructuredOutputsParams(json=_arguments_schema(function.parameters), param="tool_choice"),
        named_view(wanted),
        1,
    )


def _shown(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def _arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's arguments are an object (OpenAI's arguments are a JSON object's text), whatever the schema."""
    if parameters is None:
        return dict(NO_ARGUMENTS)
    if not parameters:
        return dict(ANY_OBJECT)
    return parameters if "type" in parameters else {**parameters, "type": "object"}


def _required_schema(tools: list[p.ToolParam], max_calls: int) -> dict[str, Any]:
    """An array of one or more calls, each naming a tool and passing arguments that follow its schema."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _arguments_schema(t.function.parameters),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if max_calls == 1:
        schema["maxItems"] = 1
    return schema


@dataclass
class ParsedReply:
    content: str | None
    tool_calls: list[p.ToolCall]


def _forced_arguments(call: ScannedCall) -> str:
    """A forced call's arguments: those of a finished call as final_calls gives them, a cut call's as generated."""
    return (call.arguments.strip() or "{}") if call.complete else call.arguments


def parse_reply(plan: ToolPlan, text: str) -> ParsedReply:
    """A finished reply: its calls, or (no valid calls) all of it as content, as the model wrote it.  A forced
    reply (required, named) is its calls only, complete or cut by max_tokens."""
    if plan.view is None:
        return ParsedReply(text, [])
    view = plan.view(text, True)
    if plan.mode in FORCED:
        named = [c for c in view.calls[: plan.max_calls] if c.name is not None]
        return ParsedReply(
            None,
            [
                p.ToolCall(id=new_call_id(), function=p.FunctionCall(name=str(c.name), arguments=_forced_arguments(c)))
                for c in named
            ],
        )
    calls = final_calls(view)
    if calls is None:
        return ParsedReply(text, [])
    calls = calls[: plan.max_calls]
    content = view.content if view.content.strip() else None
    return ParsedReply(
        content, [p.ToolCall(id=new_call_id(), function=p.FunctionCall(name=n, arguments=a)) for n, a in calls]
    )


def finish_reason(plan: ToolPlan, reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" when the model chose to call (auto) or had to (required); a named call keeps "stop"."""
    if called and reason == "stop" and plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason


@dataclass
class ToolCallStream:
    """One streamed choice: each new piece of text becomes content and tool-call deltas in OpenAI's shape.

    The text so far is re-read as a whole every time (the view is prefix-stable), and only what was not sent
    yet goes out: content that will stay content, a call's header (id, name) once its name is complete, and
    the arguments text as it grows.
    """

    plan: ToolPlan
    text: str = ""
    sent_content: int = 0
    sent_calls: list[list[Any]] = field(default_factory=list)  # [call id, arguments characters sent]

    @property
    def called(self) -> bool:
        return bool(self.sent_calls)

    def feed(self, piece: str, final: bool) -> tuple[str, list[p.DeltaToolCall]]:
        self.text += piece
        if self.plan.view is None:
            return piece, []
        view = self.plan.view(self.text, final)
        content = view.content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(view.content))
        deltas: list[p.DeltaToolCall] = []
        for i, call in enumerate(view.calls[: self.plan.max_calls]):
            if i == len(self.sent_calls):
                if call.name is None:
                    break
                self.sent_calls.append([new_call_id(), 0])
                header = True
            else:
                header = False
            call_id, sent = self.sent_calls[i]
            arguments = call.arguments[sent:]
            self.sent_calls[i][1] = max(sent, len(call.arguments))
            if header:
                deltas.append(
                    p.DeltaToolCall(
                        index=i,
                        id=call_id,
                        type="function",
                        function=p.DeltaFunctionCall(name=call.name, arguments=arguments),
                    )
                )
            elif arguments:
                deltas.append(p.DeltaToolCall(index=i, function=p.DeltaFunctionCall(arguments=arguments)))
        if final and not self.sent_calls and self.plan.mode not in FORCED and final_calls(view) is None:
            content += self.text[self.sent_content :]  # not calls after all: the rest is content, nothing is lost
            self.sent_content = len(self.text)
        return content, deltas
