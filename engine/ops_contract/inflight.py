"""The in-flight file: what an engine publishes for its supervisor to read while it drains, even after it died.

Two 8-byte counters in a small shared mapping: the requests in flight now, and the requests a stop-now answered
"restarting".  The engine writes them as they change (engine/server/handover.py); the supervisor reads the file by
path (opsctl/launcher.py), so the last values survive the engine's death (kill -9, the OOM killer).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

_COUNT = struct.Struct("<q")


class InflightFile:
    """Two shared counters: requests in flight now, and requests answered "restarting" by a stop-now."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags, 0o600)
        try:
            os.ftruncate(fd, 2 * _COUNT.size)
            self._map = mmap.mmap(fd, 2 * _COUNT.size)
        finally:
            os.close(fd)
        self.set(0)
        self.set_aborted(0)

    def set(self, value: int) -> None:
        _COUNT.pack_into(self._map, 0, value)

    def set_aborted(self, value: int) -> None:
        _COUNT.pack_into(self._map, _COUNT.size, value)

    @staticmethod
    def read(path: str | os.PathLike[str]) -> tuple[int, int] | None:
        """(in flight, aborted) as an engine last published them (None if there is no such file)."""
        try:
            data = Path(path).read_bytes()
        except OSError:
            return None
        if len(data) < 2 * _COUNT.size:
            return None
        return _COUNT.unpack_from(data, 0)[0], _COUNT.unpack_from(data, _COUNT.size)[0]
