"""Tool calls in a model's text: the formats models are trained to write them in, read whole or while streaming.

Every format is read by one `view(text, final)` that returns the text safe to show as content and the calls
found so far, each with its name (once its string is complete) and the raw JSON text of its arguments (as far as
it goes).  The same function serves a finished output and every step of a stream, so the two cannot disagree:
a streamed call's argument pieces concatenate to exactly the arguments the non-streamed response returns (the
model's own text of the value, never a re-serialisation that could differ in spacing or key order).

Formats (`--tool-call-parser`):
- `hermes` (Hermes 2/3, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, possibly
  several, after optional content.
- `llama3_json` (Llama 3.1/3.2/3.3 JSON tool calling): the whole reply is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, several separated by `;`.
And the two forms pagekeeper constrains the model to write itself: `required` (a JSON array of
`{"name", "parameters"}` objects) and a named function (the reply is the arguments object).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|"|[{}\[\]]')  # a whole string, an unterminated one's quote, a bracket
_PRIMITIVE = re.compile(r"[^\s,\]}]*")
_SPACE = re.compile(r"\s*")


@dataclass
class ScannedCall:
    name: str | None = None  # None until its string is complete
    partial_name: str | None = None  # the name's text so far while its string is not complete
    arguments: str = ""  # the raw JSON text of the arguments value, as far as the text goes
    complete: bool = False  # the call's object is closed (its arguments are final)
    end: int = 0  # where the call's text ended (complete) or where the scan stopped


@dataclass
class View:
    content: str  # text that is the reply's content and will stay so (a stream may send it now)
    calls: list[ScannedCall] = field(default_factory=list)
    invalid: bool = False  # the text stopped following the format: what follows is not a call


def value_end(text: str, i: int, final: bool) -> int | None:
    """Where the JSON value starting at text[i] ends (exclusive), or None if the text stops inside it."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        m = _STRING.match(text, i)
        return m.end() if m else None
    if c in "{[":
        depth = 0
        for m in _STRUCTURE.finditer(text, i):
            token = m.group()
            if token == '"':
                return None  # an unterminated string: the value goes on
            if token[0] == '"':
                continue
            depth += 1 if token in "{[" else -1
            if depth == 0:
                return m.end()
        return None
    primitive = _PRIMITIVE.match(text, i)
    assert primitive is not None  # it matches the empty string too
    end = primitive.end()
    if end == i:
        return None
    return end if end < len(text) or final else None  # "12" may yet become "123"


def _skip_space(text: str, i: int) -> int:
    space = _SPACE.match(text, i)
    assert space is not None  # it matches the empty string too
    return space.end()


def scan_call(text: str, i: int, arguments_keys: tuple[str, ...], final: bool) -> ScannedCall | None:
    """The call whose object starts at text[i] ('{'); None if the text is not such an object."""
    call = ScannedCall(end=i)
    if text[i] != "{":
        return None
    i += 1
    while True:
        i = _skip_space(text, i)
        if i >= len(text):
            return call
        if text[i] == "}":
            call.complete, call.end = True, i + 1
            if call.name is None:
                return None  # an object without a name is not a call
            return call
        m = _STRING.match(text, i)
        if m is None:
            return call if text[i] == '"' else None  # a key still being written, or not JSON
        key = json.loads(m.group())
        i = _skip_space(text, m.end())
        if i >= len(text):
            return call
        if text[i] != ":":
            return None
        start = _skip_space(text, i + 1)
        if start >= len(text):
            return call
        end = value_end(text, start, final)
        if key == "name":
            if end is None:
                if text[start] == '"':
                    call.partial_name = text[start + 1 :]
                return call
            name = json.loads(text[start:end])
            if not isinstance(name, str):
                return None
            call.name = name
        elif key in arguments_keys:
            call.arguments = text[start : end if end is not None else len(text)]
            if end is None:
                return call
        elif end is None:
            return call
        i = _skip_space(text, end)
        call.end = i
        if i >= len(text):
            return call
        if text[i] == ",":
            i += 1
        elif text[i] != "}":
            return None


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (and must wait)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def hermes_view(text: str, final: bool) -> View:
    start_tag, end_tag = "<tool_call>", "</tool_call>"
    first = text.find(start_tag)
    if first < 0:
        return View(text if final else text[: len(text) - _held_back(text, start_tag)])
    view = View(text[:first])
    at = first
    while at >= 0:
        i = _skip_space(text, at + len(start_tag))
        if i >= len(text):
            break
        call = scan_call(text, i, ("arguments",), final)
        if call is None:
            view.invalid = True
            break
        view.calls.append(call)
        if not call.complete:
            break
        after = _skip_space(text, call.end)
        if text.startswith(end_tag, after):
            after += len(end_tag)
        at = text.find(start_tag, after)  # words between or after calls are not content (as vLLM's parser)
    return view


def _json_sequence_view(
    text: str, final: bool, *, opening: str, separator: str, closing: str, arguments_keys: tuple[str, ...]
) -> View:
    """Calls as JSON objects one after another: `opening` obj `separator` obj ... `closing`."""
    view = View("")
    i = _skip_space(text, 0)
    if opening:
        if i >= len(text):
            return view
        if not text.startswith(opening, i):
            view.invalid = True
            return view
        i = _skip_space(text, i + len(opening))
    while i < len(text):
        call = scan_call(text, i, arguments_keys, final)
        if call is None:
            view.invalid = True
            return view
        view.calls.append(call)
        if not call.complete:
            return view
        i = _skip_space(text, call.end)
        if text.startswith(separator, i):
            i = _skip_space(text, i + len(separator))
        elif closing and text.startswith(closing, i):
            return view
        elif i < len(text):
            view.invalid = True
            return view
    return view


def llama3_json_view(text: str, final: bool) -> View:
    stripped = text.lstrip()
    if stripped.startswith("<|python_tag|>"):
        stripped = stripped[len("<|python_tag|>") :].lstrip()
    elif not final and "<|python_tag|>".startswith(stripped):
        return View("")  # not yet known whether this is a call or an answer
    elif not stripped.startswith("{"):
        return View(text)  # an answer in words
    return _json_sequence_view(
        stripped, final, opening="", separator=";", closing="", arguments_keys=("parameters", "arguments")
    )


def required_view(text: str, final: bool) -> View:
    """tool_choice "required": the constrained reply is a JSON array of {"name", "parameters"} objects."""
    return _json_sequence_view(text, final, opening="[", separator=",", closing="]", arguments_keys=("parameters",))


def forced_required_view(names: Sequence[str]) -> Callable[[str, bool], View]:
    """`required_view` for a reply the grammar forced to call one of `names`: when the reply ends (max_tokens)
    inside a call's name, or before its first call's name began, the name is still known if only one of `names`
    starts with what was written (the grammar allows nothing else); its arguments are then empty.  A later call
    cut before its name began is left out: the reply has its calls already."""

    def view(text: str, final: bool) -> View:
        found = required_view(text, final)
        if not final or found.invalid:
            return found
        last = found.calls[-1] if found.calls else None
        if last is not None and (last.name is not None or (last.partial_name is None and len(found.calls) > 1)):
            return found
        prefix = (last.partial_name or "") if last is not None else ""
        matching = [n for n in names if n.startswith(prefix)]
        if len(matching) == 1:
            if last is None:
                found.calls.append(ScannedCall(name=matching[0]))
            else:
                last.name = matching[0]
        return found

    return view


def named_view(name: str) -> Callable[[str, bool], View]:
    """tool_choice naming a function: the constrained reply is that function's arguments object."""

    def view(text: str, final: bool) -> View:
        return View("", [ScannedCall(name=name, arguments=text, complete=final, end=len(text))])

    return view


PARSERS: dict[str, Callable[[str, bool], View]] = {"hermes": hermes_view, "llama3_json": llama3_json_view}


def final_calls(view: View) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of every call in a finished reply, or None when it does not hold valid calls
    (then the whole reply is content, as the model wrote it)."""
    if view.invalid or not view.calls:
        return None
    calls = []
    for call in view.calls:
        arguments = call.arguments.strip() or "{}"
        if not call.complete or call.name is None:
            return None
        try:
            if not isinstance(json.loads(arguments), dict):
                return None
        except ValueError:
            return None
        calls.append((call.name, arguments))
    return calls
