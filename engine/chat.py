"""Chat conversations to prompt text, through the model's Jinja chat template or the operator's.

One place for the server's /v1/chat/completions, its /tokenize, and the offline `LLM.chat()`, so that the three
render a conversation the same way.  Messages arrive in OpenAI's shape; HF chat templates read a slightly
different one (a tool call's arguments as an object, not the JSON text OpenAI sends), which is converted here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from engine.config import ConfigError


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: the message says why, for a 400 (server) or an exception (offline)."""


def load_chat_template(value: str | None, flag: str = "--chat-template") -> str | None:
    """A template given as a file path or inline (vLLM's two forms); a path that is not there is a mistake.

    A value with Jinja's `{` or a newline is a template; anything else must name a readable file, so that a
    typo in a path is an error at start-up rather than a template that prints the path itself.
    """
    if value is None:
        return None
    if "{" in value or "\n" in value:
        return value
    path = Path(value)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(
            f"{flag} {value}: cannot read it ({e.strerror or e}); give a template file or the template itself"
        ) from None
    if not text.strip():
        raise ConfigError(f"{flag} {value} is empty")
    return text


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """One OpenAI message in the form chat templates read (text content, tool-call arguments as objects)."""
    out: dict[str, Any] = {"role": message["role"], "content": content_text(message.get("content"))}
    if message.get("name") is not None:
        out["name"] = message["name"]
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_template_tool_call(c) for c in calls]
    return out


def content_text(content: Any) -> str:
    """OpenAI's content: a string, a list of text parts, or None (an assistant turn that only called tools)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise ChatTemplateError(f"only text content parts are supported, not {part!r:.80}")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _template_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise ChatTemplateError(
                f"tool call {call.get('id')!r}: arguments are not JSON: {arguments!r:.80}"
            ) from None
    return {"id": call.get("id"), "type": call.get("type", "function"), "function": function}


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text for a conversation.  `chat_template` (the operator's or the caller's) wins over the
    model's; a model with neither cannot chat, and a conversation the template refuses raises with its words."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateError("the model has no chat template; give one (--chat-template) or send a plain prompt")
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("continue_final_message continues the last message: add_generation_prompt must be off")
    rendered = [template_message(m) for m in messages]
    if continue_final_message and (not rendered or rendered[-1]["role"] != "assistant"):
        raise ChatTemplateError("continue_final_message needs the conversation to end with an assistant message")
    extra: dict[str, Any] = dict(chat_template_kwargs or {})
    if continue_final_message:
        extra["continue_final_message"] = True
    try:
        text = tokenizer.apply_chat_template(
            rendered,
            tools=list(tools) if tools else None,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
    except ChatTemplateError:
        raise
    except Exception as e:  # jinja raises for conversations the template refuses (raise_exception in templates)
        raise ChatTemplateError(f"the chat template refused this conversation: {e}") from e
    return str(text)
