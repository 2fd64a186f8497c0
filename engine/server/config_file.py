"""The `[engine]` section of the deployment's TOML file: read, checked and turned into server flags.

One file describes a deployment (opsctl's `[supervisor]` sits beside `[engine]`), but the engine reads
its own section itself (`python -m engine.server --config F`, as the systemd unit runs it), so the
section's rules live here, in the engine, and the ops kit builds on them: the engine never imports
the ops kit.  Keys are the flag names with dashes turned into underscores; every key has a type and a
range (the dataclasses ServerConfig and EngineConfig, checked strictly by one pydantic schema), and
each mistake is one line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import stat
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import tomllib

from engine.config import INTERNAL_FIELDS as ENGINE_INTERNAL_FIELDS
from engine.config import ConfigError, EngineConfig
from engine.ops_contract.secrets import SECRET_ENV
from engine.schema import validate_section
from engine.server.settings import INTERNAL_FIELDS, ServerConfig

SECTIONS = ("engine", "supervisor")

# Keys never put on a command line, and the environment variables the server reads them from.

# Server flags of `python -m engine.server` that are not engine flags, with their defaults.
SERVER_KEYS = {f.name: f.default for f in dataclasses.fields(ServerConfig) if f.name not in INTERNAL_FIELDS}


def engine_file_keys() -> set[str]:
    """The engine's keys a config file may set (the supervisor's per-start flags are not among them)."""
    return EngineConfig.field_names() - set(ENGINE_INTERNAL_FIELDS)


def read_config_file(path: Path) -> dict[str, dict[str, Any]]:
    """The file's sections (keys with dashes as underscores); a malformed file is one ConfigError line."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    unknown = set(raw) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {sorted(unknown)}; use [engine] and [supervisor]")
    sections: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        values = raw.get(name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: [{name}] must be a table of keys")
        sections[name] = {k.replace("-", "_"): v for k, v in values.items()}
    if any(sections["engine"].get(key) for key in SECRET_ENV):
        _check_private(path)
    return sections


def _check_private(path: Path) -> None:
    """A file that holds a key is as secret as a key file: readable by its owner only."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"{path} holds [engine] api_key/admin_key but has mode {mode:04o}: others can read the key; "
            f"`chmod 600 {path}`, or move the key to api_key_file / PAGEKEEPER_API_KEY"
        )


def validate_engine_section(values: dict[str, Any], source: str) -> dict[str, Any]:
    """The section's values, checked (server keys and engine keys, and the engine's own combinations)."""
    server_part = {k: v for k, v in values.items() if k in SERVER_KEYS}
    engine_part = {k: v for k, v in values.items() if k not in SERVER_KEYS}
    unknown = sorted(set(engine_part) - engine_file_keys())
    if unknown:
        known = ", ".join(sorted(engine_file_keys() | set(SERVER_KEYS)))
        raise ConfigError(f"{source}: unknown key [engine] {unknown[0]!r}; known keys: {known}")
    server_part = validate_section(ServerConfig, server_part, f"{source}: [engine]", exclude=INTERNAL_FIELDS)
    engine_part = validate_section(EngineConfig, engine_part, f"{source}: [engine]", exclude=ENGINE_INTERNAL_FIELDS)
    try:
        EngineConfig.from_kwargs(**engine_part)  # the engine's own ranges and combinations
    except ConfigError as e:  # its messages name flags; in a file the keys are what a person edits
        text = in_config_terms(str(e), values)
        raise ConfigError(f"{source}: {text if '[engine]' in text else '[engine] ' + text}") from None
    return {**server_part, **engine_part}


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
            for shown in (str(value), json.dumps(str(value))):  # as engine_args passed it, or quoted by the schema
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


def engine_args(values: dict[str, Any]) -> list[str]:
    """The section as `python -m engine.server` flags (booleans as --x / --no-x), secrets excluded:
    any local user can read a command line (`ps`), so keys travel in the environment (`engine_env`)."""
    args: list[str] = []
    for key, value in values.items():
        if value is None or key in SECRET_ENV:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if key in SERVER_KEYS:  # server booleans are store_true flags
                if value:
                    args.append(flag)
            else:
                args.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            args.extend([flag, str(value)])
    return args


def engine_env(values: dict[str, Any]) -> dict[str, str]:
    """The section's keys as the environment variables the server reads."""
    return {env: str(values[key]) for key, env in SECRET_ENV.items() if values.get(key)}


def error_in_file_terms(message: str, argv: Sequence[str]) -> str:
    """An error of `python -m engine.server ARGV` as the person who wrote its `--config` file reads it: the values
    that came from the file (no flag on the command line overrode them) named by their keys, after the file's
    path.  Without a file, or when the error concerns no value of it, the message is unchanged."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    path = pre.parse_known_args(list(argv))[0].config
    if not path:
        return message
    try:
        section = load_engine_section(path)
    except ConfigError:
        return message  # the file itself is the error: its message names it already
    given = {arg[2:].split("=", 1)[0].replace("-", "_").removeprefix("no_") for arg in argv if arg.startswith("--")}
    text = in_config_terms(message, section, [key for key in section if key not in given])
    return message if text == message else f"{Path(path).resolve()}: {text}"


def load_engine_section(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What `python -m engine.server --config F` takes from F: its checked [engine] section."""
    candidate = Path(path)
    if not candidate.exists():
        raise ConfigError(f"--config {candidate}: no such file")
    return validate_engine_section(read_config_file(candidate)["engine"], str(candidate.resolve()))
