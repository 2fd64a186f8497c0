"""The engine's keys (`api_key`, `admin_key`) and the one rule that says which value an engine uses.

An engine takes each key from its flag, else from its environment variable (SECRET_ENV), else from its config
file's `[engine]` section, or from a key file (a flag or the section's `<key>_file`) given instead of all of these.
The supervisor starts the engine from the same file and environment and must probe it with the key the engine
uses: `key_from_config` is that rule for an engine started without key flags, as opsctl starts it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import Any

from engine.config import ConfigError

SECRET_ENV = {"api_key": "PAGEKEEPER_API_KEY", "admin_key": "PAGEKEEPER_ADMIN_KEY"}


def read_secret(path: str, flag: str) -> str:
    """A key from a file only its owner can read (0600 or 0400), owned by this user or root."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise ConfigError(f"{flag} {path}: {e.strerror}") from None
    with os.fdopen(fd) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid not in (os.geteuid(), 0):
            raise ConfigError(f"{flag} {path}: not a regular file of yours or root's")
        if info.st_mode & 0o077:
            raise ConfigError(
                f"{flag} {path} has mode {stat.S_IMODE(info.st_mode):04o}: others can read the key; `chmod 600 {path}`"
            )
        key = f.read().strip()
    if not key:
        raise ConfigError(f"{flag} {path} is empty")
    return key


def key_from_config(name: str, section: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> str | None:
    """The key `name` an engine started from config `section` and `environ` (default: this process's) uses: the
    environment's, else the section's, else the section's key file; a key file beside a key given another way is
    refused, as the engine refuses it (ConfigError)."""
    env = os.environ if environ is None else environ
    value = env.get(SECRET_ENV[name]) or section.get(name) or None
    path = section.get(f"{name}_file")
    if not path:
        return value
    if value is not None:
        raise ConfigError(
            f"[engine] {name}_file and {name} (in the file or as {SECRET_ENV[name]}) both give the key; keep one"
        )
    return read_secret(str(path), f"[engine] {name}_file")
