"""sd_notify for `Type=notify` units: READY, STATUS, STOPPING and the watchdog, by the protocol itself.

The protocol is one datagram of `KEY=value` lines to the unix socket named by `$NOTIFY_SOCKET` (a path,
or an abstract-namespace name when it starts with `@`), so it is implemented here directly rather than
through a dependency.  Without `$NOTIFY_SOCKET` (not started by systemd) every call is a no-op and the
engine runs unchanged.

The watchdog is pinged from the step loop's heartbeat (`AsyncEngine.add_step_hook`), never from a timer
thread of its own: a hung step loop stops the pings and systemd restarts the engine.  Pings are sent
at most every half `$WATCHDOG_USEC`, as sd_watchdog_enabled(3) recommends.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable

import structlog

log = structlog.get_logger("pagekeeper.server")


class Notifier:
    """One process's channel to its service manager.  Thread-safe; every method is cheap."""

    def __init__(self, environ: dict[str, str] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        env = os.environ if environ is None else environ
        self.address = _address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_interval = _watchdog_interval(env)
        self._clock = clock
        self._last_ping = float("-inf")
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._failed = False
        if environ is None:
            # Not for our children (a compiler or a worker must not talk to systemd as if it were us).
            for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(var, None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_enabled(self) -> bool:
        return self.enabled and self.watchdog_interval is not None

    def notify(self, **fields: str | int) -> bool:
        """Send `KEY=value` lines (keyword names upper-cased); False when not under systemd or on error."""
        if self.address is None:
            return False
        message = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.sendto(message, self.address)
                return True
            except OSError as e:
                if not self._failed:  # say it once: a dead notify socket must not flood the log
                    self._failed = True
                    log.warning("sd_notify_failed", error=str(e), socket=os.fsdecode(self.address))
                return False

    def status(self, text: str) -> bool:
        return self.notify(status=_one_line(text))

    def ready(self, status: str) -> bool:
        """The service is up: systemd's `systemctl start` returns now (Type=notify)."""
        if not self.watchdog_enabled:
            return self.notify(ready=1, status=_one_line(status))
        self._last_ping = self._clock()
        return self.notify(ready=1, status=_one_line(status), watchdog=1)

    def stopping(self, status: str) -> bool:
        return self.notify(stopping=1, status=_one_line(status))

    def watchdog(self) -> bool:
        """Ping the watchdog, at most every half WatchdogSec; call it as often as convenient."""
        if not self.watchdog_enabled:
            return False
        now = self._clock()
        interval = self.watchdog_interval
        assert interval is not None  # watchdog_enabled says so
        if now - self._last_ping < interval / 2:
            return False
        self._last_ping = now
        return self.notify(watchdog=1)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def _address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()  # abstract namespace
    if value.startswith("/"):
        return value
    return None  # sd_notify(3) accepts only these two forms


def _watchdog_interval(env: dict[str, str] | os._Environ[str]) -> float | None:
    """WatchdogSec in seconds if the watchdog is meant for this process (WATCHDOG_PID unset or ours)."""
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
        pid = int(env.get("WATCHDOG_PID", "0") or 0)
    except ValueError:
        return None
    if usec <= 0 or (pid and pid != os.getpid()):
        return None
    return usec / 1e6


def _one_line(text: str) -> str:
    return " ".join(text.split())


_notifier: Notifier | None = None


def get_notifier() -> Notifier:
    """The process-wide notifier (reads and clears $NOTIFY_SOCKET/$WATCHDOG_* on first use)."""
    global _notifier
    if _notifier is None:
        _notifier = Notifier()
    return _notifier
