"""The runtime dir (control socket, pid file, engine state, logs): private, and trusted only when it is.

Everything opsctl writes there is read back as truth (which engine to adopt, which socket to command),
so a directory another user can write to, or a log file swapped for a symlink to someone else's file,
would let a local user steer or clobber things.  The dir is created 0700; an existing one must belong
to this user and be writable by nobody else; files are opened without following symlinks.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import IO, Any

from engine.config import ConfigError
from opsctl.constants import LAST_FAILURE_NAME

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def prepare_runtime_dir(path: Path) -> Path:
    """Create the dir 0700 (parents as needed), or check that an existing one is private to this user."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(
            f"runtime dir {path} is a symlink; point --runtime-dir (or [supervisor] runtime_dir) at a real directory"
        )
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"runtime dir {path} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}); "
            "use a directory of your own (--runtime-dir)"
        )
    if info.st_mode & 0o022:
        raise ConfigError(
            f"runtime dir {path} has mode {stat.S_IMODE(info.st_mode):04o}: others can write to it; "
            f"`chmod 700 {path}` or use another --runtime-dir"
        )
    return path


def open_private(path: Path, mode: str = "ab") -> IO[bytes]:
    """Open (create 0600) a file in the runtime dir for appending or writing, never through a symlink."""
    flags = os.O_WRONLY | os.O_CREAT | _NOFOLLOW | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        if os.path.islink(path):
            raise ConfigError(f"{path} is a symlink; refusing to write through it (remove it)") from None
        raise ConfigError(f"cannot open {path}: {e.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise ConfigError(f"{path} is not a regular file of yours; refusing to write to it (remove it)")
    return os.fdopen(fd, mode if "b" in mode else mode + "b")


def write_private(path: Path, text: str) -> None:
    """Replace a small state file atomically (write a private temp file, then rename over)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    with open_private(tmp, "wb") as f:
        f.write(text.encode())
    tmp.replace(path)


def write_last_failure(runtime: Path, detail: str) -> None:
    """Why the supervisor exited before the engine served, for `opsctl start` and `opsctl status` to say."""
    write_private(runtime / LAST_FAILURE_NAME, json.dumps({"time": time.time(), "reason": detail}))


def read_last_failure(runtime: Path) -> dict[str, Any] | None:
    try:
        return json.loads((runtime / LAST_FAILURE_NAME).read_text())
    except (OSError, ValueError):
        return None
