"""Strict validation of a settings dataclass from a dict (a TOML section, parsed flags), with one-line errors.

The dataclasses that use the settings (EngineConfig, ServerConfig, SupervisorConfig) are the one place
where a key, its type, its default and its range (pydantic `Field` metadata in `Annotated`) are written;
this turns them into a strict pydantic model, so that a string is never a boolean and an unknown key
is an error.
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from engine.config import ConfigError


@lru_cache(maxsize=None)
def _schema(cls: type, exclude: tuple[str, ...] = ()) -> type[BaseModel]:
    """A strict pydantic model of a dataclass's fields (types and the ranges in their Annotated metadata)."""
    hints = get_type_hints(cls, include_extras=True)
    # (type, default) per field; Any: create_model takes them as keyword arguments beside its own `__config__`
    fields: dict[str, Any] = {
        f.name: (hints[f.name], f.default) for f in dataclasses.fields(cls) if f.name not in exclude
    }
    return create_model(f"{cls.__name__}Schema", __config__=ConfigDict(extra="forbid", strict=True), **fields)


def _shown(value: Any) -> str:
    return json.dumps(value, default=str) if isinstance(value, (str, bool, int, float)) else repr(value)


def validate_section(
    cls: type, values: dict[str, Any], where: str, flag_style: bool = False, exclude: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The values, checked against `cls`'s schema; the first mistake as one ConfigError line."""
    schema = _schema(cls, exclude)
    try:
        model = schema.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else "?"
        msg = str(err["msg"]).removeprefix("Value error, ")
        if flag_style:
            raise ConfigError(f"--{key.replace('_', '-')} {_shown(err.get('input'))}: {msg}") from None
        if err["type"] == "extra_forbidden":
            known = ", ".join(sorted(schema.model_fields))
            raise ConfigError(f"{where}: unknown key {key!r}; known keys: {known}") from None
        raise ConfigError(f"{where} {key} = {_shown(err.get('input'))}: {msg}") from None
    return {k: getattr(model, k) for k in values}
