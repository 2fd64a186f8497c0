"""The `[engine]` section of the deployment's TOML file: checked by the settings' one schema, and its mistakes
told in its keys.

One file describes a deployment (opsctl's `[supervisor]` sits beside `[engine]`), but the engine reads
its own section itself (`python -m engine.server --config F`, as the systemd unit runs it, and as opsctl
starts its engines: engine/ops_contract/config_file.py), so the section's rules live here, in the engine,
and the ops kit builds on them: the engine never imports the ops kit.  Keys are the flag names with
dashes turned into underscores; every key has a type and a range (the dataclasses ServerConfig and
EngineConfig, checked by one strict pydantic schema, engine/schema.py), and each mistake is one line
naming the key, the value and what is allowed: the schema's line in flag terms, told in the file's keys
by `in_config_terms`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from engine.config import INTERNAL_FIELDS as ENGINE_INTERNAL_FIELDS
from engine.config import ConfigError, EngineConfig
from engine.ops_contract.config_file import SECTIONS, read_config_file
from engine.schema import validate_section
from engine.server.settings import INTERNAL_FIELDS, ServerConfig

__all__ = ["SECTIONS", "SERVER_KEYS", "read_config_file", "validate_engine_section", "load_engine_section"]

# Server flags of `python -m engine.server` that are not engine flags, with their defaults.
SERVER_KEYS = {f.name: f.default for f in dataclasses.fields(ServerConfig) if f.name not in INTERNAL_FIELDS}


def engine_file_keys() -> set[str]:
    """The engine's keys a config file may set (the supervisor's per-start flags are not among them)."""
    return EngineConfig.field_names() - set(ENGINE_INTERNAL_FIELDS)


def split_section(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An [engine] section's (or a command line's) values as (the server's, the engine's)."""
    server_keys = ServerConfig.__dataclass_fields__
    return {k: v for k, v in values.items() if k in server_keys}, {
        k: v for k, v in values.items() if k not in server_keys
    }


def validate_engine_section(values: dict[str, Any], source: str) -> dict[str, Any]:
    """The section's values, checked by the settings' schema (server keys and engine keys, each key and their
    combinations); a mistake is the schema's line told in the file's keys."""
    unknown = sorted(set(values) - engine_file_keys() - set(SERVER_KEYS))
    if unknown:
        known = ", ".join(sorted(engine_file_keys() | set(SERVER_KEYS)))
        raise ConfigError(f"{source}: unknown key [engine] {unknown[0]!r}; known keys: {known}")
    server_part, engine_part = split_section(values)
    try:
        server_part = validate_section(ServerConfig, server_part)
        engine_part = validate_section(EngineConfig, engine_part)
    except ConfigError as e:  # the schema names flags; in a file the keys are what a person edits
        text = in_config_terms(str(e), values)
        raise ConfigError(f"{source}: {text if '[engine]' in text else '[engine] ' + text}") from None
    return {**server_part, **engine_part}


def in_file_terms(message: str, source: str, values: Mapping[str, Any], keys: Collection[str] | None = None) -> str:
    """An error naming flags, as the person who wrote the file `source` reads it (`F: [engine] key = value: ...`);
    unchanged when it names none of `keys` (default: every key)."""
    text = in_config_terms(message, values, keys)
    return message if text == message else f"{source}: {text}"


_FLAG = re.compile(r"--([a-z0-9][a-z0-9-]*)")
_NUMBER = re.compile(r" (-?[0-9][0-9._]*)(?=[ :;,)]|$)")
_VALUE_ENDS = " :;,)"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else str(value)


def in_config_terms(message: str, values: Mapping[str, Any], keys: Collection[str] | None = None) -> str:
    """An engine error that names flags, told in the terms of the config file the values came from: the one
    mapping from a flag to its key, wherever an engine error is shown for a config-file value (the file's own
    checks here, the engine reading `--config`, opsctl showing why the engine it started exited).

    `--model /x: no such directory` becomes `[engine] model = "/x": no such directory` (the flag followed by the
    value `values` holds for it, or a number: `use --max-model-len 256` becomes `use [engine] max_model_len = 256`),
    any other `--max-model-len` `[engine] max_model_len`.  `keys`: the keys to reword (default every [engine] key);
    a flag given on a command line stays a flag."""
    known = EngineConfig.field_names() | set(SERVER_KEYS)
    wanted = known if keys is None else known & set(keys)
    out: list[str] = []
    pos = 0
    for m in _FLAG.finditer(message):
        key = m.group(1).replace("-", "_")
        if m.start() < pos or key not in wanted:
            continue
        out.append(message[pos : m.start()])
        text, end = f"[engine] {key}", m.end()
        value = values.get(key)
        if value is not None and not isinstance(value, bool):
            for shown in (str(value), json.dumps(str(value))):  # as a flag's value, or quoted by the schema
                after = message[end : end + len(shown) + 2]
                if after.startswith(" " + shown) and (len(after) == len(shown) + 1 or after[-1] in _VALUE_ENDS):
                    text, end = f"[engine] {key} = {_toml(value)}", end + 1 + len(shown)
                    break
        if text == f"[engine] {key}" and (number := _NUMBER.match(message, end)):
            text, end = f"[engine] {key} = {number.group(1)}", number.end()
        out.append(text)
        pos = end
    out.append(message[pos:])
    return "".join(out)


def load_engine_section(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What `python -m engine.server --config F` takes from F: its checked [engine] section."""
    candidate = Path(path)
    if not candidate.exists():
        raise ConfigError(f"--config {candidate}: no such file")
    return validate_engine_section(read_config_file(candidate)["engine"], str(candidate.resolve()))
