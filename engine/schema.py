"""The one strict schema of every settings dataclass, and its mistakes as one line.

The dataclasses that use the settings (EngineConfig, ServerConfig, SupervisorConfig) are the one place
where a key, its type, its default, its range (`annotated_types` or pydantic `Field` metadata in
`Annotated`), its choices (`Literal`) and the checks across keys (`check_combinations`) are written;
this turns them into a strict pydantic model, so that a string is never a boolean and an unknown key
is an error.  Every way in runs it: the constructors (EngineConfig, ServerConfig), the server's flags
and the TOML file's sections.  A mistake is said in flag terms (`--max-num-seqs must be >= 1, got 0`),
which engine/server/config_file.py tells in a config file's keys, or, for a section that has no flags
([supervisor]), in its keys directly.
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, create_model, model_validator

from engine.config import ConfigError


@lru_cache(maxsize=None)
def _schema(cls: type) -> type[BaseModel]:
    """A strict pydantic model of a dataclass's fields (types, ranges, choices) and its cross-key checks."""
    hints = get_type_hints(cls, include_extras=True)
    # (type, default) per field; Any: create_model takes them as keyword arguments beside its own `__config__`
    fields: dict[str, Any] = {f.name: (hints[f.name], f.default) for f in dataclasses.fields(cls)}
    validators: dict[str, Any] = {}
    checks = getattr(cls, "check_combinations", None)
    if checks is not None:

        def combinations(model: Any) -> Any:
            checks(model)  # a ValueError (ConfigError) in the dataclass's own words
            return model

        validators["combinations"] = model_validator(mode="after")(combinations)
    return create_model(
        f"{cls.__name__}Schema",
        __config__=ConfigDict(extra="forbid", strict=True),
        __validators__=validators,
        **fields,
    )


def _shown(value: Any) -> str:
    return json.dumps(value, default=str) if isinstance(value, (str, bool, int, float)) else repr(value)


def _walk(hint: Any) -> list[Any]:
    """Every type and every piece of Annotated metadata inside a field's annotation."""
    found = [hint]
    if get_origin(hint) is Annotated:
        base, *meta = get_args(hint)
        for m in meta:
            found += [m, *getattr(m, "metadata", ())]  # pydantic's Field(ge=...) keeps its bounds in .metadata
        return found + _walk(base)
    for arg in get_args(hint) if get_origin(hint) is not Literal else ():
        found += _walk(arg)
    return found


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _bounds(hint: Any) -> str | None:
    """A field's range as `>= 1`, `> 0`, `in (0, 1]`; None when it has none."""
    low: tuple[str, Any] | None = None
    high: tuple[str, Any] | None = None
    for m in _walk(hint):
        for name in ("ge", "gt"):
            if getattr(m, name, None) is not None:
                low = (name, getattr(m, name))
        for name in ("le", "lt"):
            if getattr(m, name, None) is not None:
                high = (name, getattr(m, name))
    if low and high:
        return (
            f"in {'[' if low[0] == 'ge' else '('}{_number(low[1])}, {_number(high[1])}{']' if high[0] == 'le' else ')'}"
        )
    if low or high:
        op, value = low or high  # type: ignore[misc]
        return f"{dict(ge='>=', gt='>', le='<=', lt='<')[op]} {_number(value)}"
    return None


def _choices(hint: Any) -> tuple[Any, ...]:
    return tuple(c for m in _walk(hint) if get_origin(m) is Literal for c in get_args(m))


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, str]:
    return {f.name: f.metadata["hint"] for f in dataclasses.fields(cls) if "hint" in f.metadata}


def _phrase(cls: type, key: str, err: Any) -> str | None:
    """pydantic's refusal of a choice or a range as the engine says it (`must be one of 8, 16, 32`), or None.
    A field's `hint` metadata follows it (what is not supported and why)."""
    hint = get_type_hints(cls, include_extras=True).get(key)
    if err["type"] == "literal_error":
        text = "must be one of " + ", ".join(str(c) for c in _choices(hint))
    elif err["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        text = f"must be {_bounds(hint) or err['msg'].removeprefix('Input should be ')}"
    else:
        return None
    return text


def validate_section(
    cls: type, values: dict[str, Any], source: str | None = None, section: str | None = None
) -> dict[str, Any]:
    """The values, checked against `cls`'s schema; the first mistake as one ConfigError line: in flag terms
    (`--block-size must be one of 8, 16, 32, got 12`), or with `section`, in the terms of that section of the
    config file `source` (`F: [supervisor] poll_interval = 0: must be in (0, 3600]`)."""
    schema = _schema(cls)
    try:
        model = schema.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        if not err["loc"]:  # a check across keys: its own words
            raise ConfigError(msg if section is None else f"{source}: {msg}") from None
        key = str(err["loc"][0])
        if section is not None and err["type"] == "extra_forbidden":
            known = ", ".join(sorted(schema.model_fields))
            raise ConfigError(f"{source}: [{section}]: unknown key {key!r}; known keys: {known}") from None
        phrase = _phrase(cls, key, err)
        shown = _shown(err.get("input"))
        extra = f" ({_hints(cls)[key]})" if phrase and key in _hints(cls) else ""
        if section is not None:
            raise ConfigError(f"{source}: [{section}] {key} = {shown}: {phrase or msg}{extra}") from None
        flag = "--" + key.replace("_", "-")
        raise ConfigError((f"{flag} {phrase}, got {shown}" if phrase else f"{flag} {shown}: {msg}") + extra) from None
    return {k: getattr(model, k) for k in values}


def check_settings(settings: Any) -> None:
    """A settings dataclass's values, checked by its schema as it is built (ConfigError in flag terms)."""
    validate_section(type(settings), {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)})
