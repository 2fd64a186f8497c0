"""The deployment's TOML file as both sides read and write it: `[engine]` and `[supervisor]`, keys with dashes as
underscores, private to its owner when it holds a key.

The engine reads its section itself (`python -m engine.server --config F`, as the systemd unit runs it); the
supervisor hands the engines it starts the section it checked as such a file too (`write_engine_section`), so that
one format, read by one function and checked by one schema, carries the settings between the two processes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import tomllib

from engine.config import ConfigError
from engine.ops_contract.secrets import SECRET_ENV

SECTIONS = ("engine", "supervisor")


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


def write_engine_section(path: Path, values: dict[str, Any]) -> Path:
    """`values` (a checked [engine] section) as a file the engine reads with `--config`: written whole under a
    temporary name, then renamed, mode 0600 (it may hold a key).  Unset (None) keys are left out, as TOML has no
    null: the engine's default is what None means."""
    import tomli_w

    text = tomli_w.dumps({"engine": {k: v for k, v in values.items() if v is not None}})
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)
    return path
