"""Size-based rotation of the logs the process launcher writes (engine.log, supervisor.log).

The engine writes its log through a file descriptor it inherited, and it must keep serving, and
logging, whether or not a supervisor is alive to read a pipe from it; so the log is a plain file the
engine appends to, and rotation is copy-then-truncate: the current content goes to `NAME.1` (older
copies shift to `.2`, `.3`, ...) and the file is truncated in place.  The writers opened it with
O_APPEND, so their next line lands at the new end: no hole, no reopen, no signal to the engine.
Lines written between the copy and the truncation are lost, a window of microseconds per rotation
(logrotate's copytruncate has the same one).  Under systemd, journald rotates and this is not used.
"""

from __future__ import annotations

import os
from pathlib import Path

from opsctl.runtime import open_private

_CHUNK = 1 << 20


def backup_path(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def rotate_if_large(path: Path, max_bytes: int, backups: int) -> bool:
    """Rotate `path` when it is larger than `max_bytes`, keeping `backups` old copies; True if it did."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if info.st_size <= max_bytes:
        return False
    if backups > 0:
        for n in range(backups - 1, 0, -1):  # .2 -> .3, .1 -> .2 (the oldest is replaced)
            older = backup_path(path, n)
            if os.path.lexists(older):
                os.replace(older, backup_path(path, n + 1))
        tmp = path.with_name(f".{path.name}.rotating")
        tmp.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as src, open_private(tmp, "wb") as dst:
            while chunk := src.read(_CHUNK):
                dst.write(chunk)
        os.replace(tmp, backup_path(path, 1))
    with open_private(path, "wb"):  # truncate in place (never through a symlink); writers keep their fd
        pass
    return True
