"""The engine's listening socket: bound here, handed over by opsctl, or passed in by systemd.

Shared by the server and by opsctl's process launcher (which binds once and hands the socket to
every engine it starts, so connections queue in the kernel across restarts).
"""

from __future__ import annotations

import os
import socket

from engine.config import ConfigError

SD_LISTEN_FDS_START = 3


def bind(host: str, port: int, hint: str = "use --port") -> socket.socket:
    """A listening, inheritable TCP socket; a taken port is a ConfigError that says what to change."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}; stop whatever holds it or {hint}") from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def inherited_socket(listen_fd: int | None) -> socket.socket | None:
    """A listening socket handed over by opsctl (--listen-fd) or systemd socket activation (LISTEN_FDS).

    Serving on a socket someone else holds open means that during a restart, connections wait in
    the kernel's queue for the next engine instead of being refused.
    """
    if listen_fd is not None:
        return socket.socket(fileno=listen_fd)
    fds = os.environ.get("LISTEN_FDS")
    pid = os.environ.get("LISTEN_PID")
    if fds and int(fds) >= 1 and (pid is None or int(pid) == os.getpid()):
        for var in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
            os.environ.pop(var, None)  # not for our children
        return socket.socket(fileno=SD_LISTEN_FDS_START)
    return None
