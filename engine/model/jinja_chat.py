"""Chat templates rendered the way transformers' `apply_chat_template` renders them, with jinja2 alone.

A checkpoint's template is written against transformers' environment: a sandbox with trim_blocks and
lstrip_blocks, loop controls, its `tojson` (no HTML escaping, indent/separators/sort_keys), `raise_exception`,
`strftime_now`, a `dict` and a `namespace` that templates cannot break out of, and the `{% generation %}` tag.  The
conversation is handed over as transformers 5 hands it: message objects as plain dicts with their None-valued keys
dropped, every value rebuilt from plain JSON types, the reasoning fields aliased, and a final message continued
through its tag.  tests/engine/test_light_tokenizer.py renders the same conversations with both.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_MIN_JINJA = (3, 1, 6)  # older jinja2 has known sandbox escapes; transformers refuses it too


def pick_template(own: str | dict[str, str] | None, chat_template: Any, tools: Any) -> str:
    """The template text: `chat_template` (text, or the name of one of the model's), else the model's own (its
    "tool_use" template when tools are given and it has one, else its "default")."""
    if isinstance(own, dict):
        if chat_template is not None and chat_template in own:
            return own[chat_template]
        if chat_template is None:
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise ValueError(
                "This model has multiple chat templates with no default specified! Please either pass a chat "
                "template or the name of the template you wish to use to the `chat_template` argument. Available "
                f"template names are {sorted(own.keys())}."
            )
    elif chat_template is None:
        if own is None:
            raise ValueError(
                "Cannot use chat template functions because tokenizer.chat_template is not set and no template "
                "argument was passed!"
            )
        return own
    return str(chat_template)


def render_conversations(
    template: str,
    conversations: list[Any],
    *,
    tools: list[Any] | None,
    documents: list[Any] | None,
    add_generation_prompt: bool,
    continue_final_message: bool | str,
    template_kwargs: dict[str, Any],
) -> list[str]:
    """One rendered text per conversation."""
    compiled = _compile(template)
    tool_schemas = None if tools is None else [_tool_schema(t) for t in tools]
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    tool_schemas = _plain(tool_schemas)
    documents = _plain(documents)
    kwargs = _plain(template_kwargs)
    out = []
    for conversation in conversations:
        chat = _plain(normalize_messages(conversation))
        chat = _alias_reasoning(chat)
        final_message: Any = None
        field = "content"
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final_message = _tag_final_message(template, chat, field)
        text = compiled.render(
            messages=chat,
            tools=tool_schemas,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        if continue_final_message:
            text = _cut_at_tag(text, final_message)
        out.append(text)
    return out


def normalize_messages(conversation: Any) -> list[dict[str, Any]]:
    """Message objects (pydantic models, dataclasses, mappings) as dicts, without their None-valued keys."""
    messages = _objects_to_dicts(getattr(conversation, "messages", conversation))
    normalized = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        normalized.append({k: v for k, v in message.items() if v is not None})
    return normalized


def _tag_final_message(template: str, chat: list[dict[str, Any]], field: str) -> Any:
    """Mark the end of the final message, so that what the template writes after it can be cut off."""
    if not chat:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    final_message = chat[-1].get(field)
    if final_message is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final_message]
    if not any(f in template for f in fields):
        raise ValueError(
            f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template'
        )
    if isinstance(final_message, (list, tuple)):
        for block in reversed(final_message):
            if "text" in block:
                final_message = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                return final_message
        raise ValueError(
            "continue_final_message is set but we could not find any text to continue in the final message!"
        )
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final_message


def _cut_at_tag(text: str, final_message: Any) -> str:
    if final_message.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat after applying the "
            "chat template! This can happen if the chat template deletes portions of the final message."
        )
    at = text.rindex(_CONTINUE_TAG.strip())
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


def _tool_schema(tool: Any) -> Any:
    if isinstance(tool, dict):
        return tool
    import inspect

    if inspect.isfunction(tool) or inspect.ismethod(tool):
        # A Python function as a tool: its schema from its signature and docstring, which transformers derives
        # (rare: the server and vLLM's offline API pass JSON schemas), so transformers is imported only here.
        from transformers.utils.chat_template_utils import get_json_schema

        return get_json_schema(tool)
    raise ValueError(
        "Tools should either be a JSON schema, or a callable function with type hints "
        "and a docstring suitable for auto-conversion to a schema."
    )


def _alias_reasoning(chat: list[Any]) -> list[Any]:
    """`reasoning_content` filled from its older names, and `thinking` for templates that read that."""
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _objects_to_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _objects_to_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_objects_to_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_objects_to_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _objects_to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _objects_to_dicts(value.model_dump())
    return value


def _plain(value: Any) -> Any:
    """Everything the template sees, rebuilt from plain JSON types (anything else becomes "<TypeName>"): objects
    with methods are kept out of the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and type(value).__name__ != "ndarray":  # numpy scalars (np.generic)
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


@lru_cache
def _compile(template: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < _MIN_JINJA:
        raise ImportError(f"chat templates need jinja2>=3.1.6 (sandbox fixes); this is {jinja2.__version__}")

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's text; rendered as its body here."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore-prefixed attributes (no way to CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 -- jinja's own signature trick
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute."
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)
