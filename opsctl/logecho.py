"""Echo the engine's log file to the supervisor's stdout as JSON lines: a container's log.

In a container the runtime collects stdout, and `kubectl logs` reads only that.  The process launcher
writes the engine's output to engine.log in the runtime dir (the supervisor reads its tail to say why an
engine exited, and rotates it by size), so instead of redirecting the engine, this thread follows the file
and copies every new line to stdout.  The engine already logs JSON; anything else it prints (the start
marker, a traceback, a third-party library's plain line) is wrapped into a JSON object, so that every
line of the container's log parses.  A rotation copies the file to .1 and truncates it in place: on a file
that shrank, the rest of .1 is echoed, then the file is read again from its start.  Only lines written after
the supervisor started are echoed (the runtime dir, an emptyDir, outlives a container restart, and its old
lines were echoed by the previous container).
"""

from __future__ import annotations

import json
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

from opsctl.logrotate import backup_path

_CHUNK = 1 << 20


def as_json_line(line: str) -> str:
    """One log line as a JSON object's text: the engine's own JSON as it is, any other text wrapped."""
    text = line.rstrip("\r\n")
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        return text
    return json.dumps(
        {
            "event": "engine_output",
            "line": text,
            "logger": "pagekeeper.engine",
            "timestamp": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"),
        }
    )


class LogEcho:
    """A daemon thread that copies lines appended to `path` to `out`, each as one JSON line."""

    def __init__(self, path: Path, out: TextIO | None = None, interval_s: float = 0.2) -> None:
        self.path = path
        self.out = out or sys.stdout
        self.interval_s = interval_s
        self._offset = self._size()
        self._partial = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="logecho", daemon=True)

    def start(self) -> LogEcho:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Echo what is left (an engine's last lines before the container exits), then stop."""
        self._stop.set()
        self._thread.join(5)
        self._echo_new()

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._echo_new()
            except (OSError, ValueError):  # a closed stdout or a vanished file must not end the supervisor
                pass

    def _echo_new(self) -> None:
        size = self._size()
        if size < self._offset:  # rotated: copied to .1, then truncated in place
            self._echo_from(backup_path(self.path, 1), self._offset)  # what was written before the copy
            self._offset, self._partial = 0, b""
        while size > self._offset:
            read = self._echo_from(self.path, self._offset, size - self._offset)
            if not read:  # gone or truncated meanwhile: the next round sees it
                return
            self._offset += read

    def _echo_from(self, path: Path, offset: int, limit: int = _CHUNK) -> int:
        """Echo the complete lines of path[offset:offset+limit] (a partial last line waits); bytes read."""
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(min(limit, _CHUNK))
        except OSError:
            return 0
        *lines, self._partial = (self._partial + data).split(b"\n")
        for raw in lines:
            if raw.strip():
                self.out.write(as_json_line(raw.decode(errors="replace")) + "\n")
        self.out.flush()
        return len(data)
