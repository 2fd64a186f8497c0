"""The engine's listening socket: bound here, handed over by opsctl, or passed in by systemd.

Shared by the server and by opsctl's process launcher (which binds once and hands the socket to
every engine it starts, so connections queue in the kernel across restarts).
"""

from __future__ import annotations

import errno
import os
import socket

from engine.config import ConfigError

SD_LISTEN_FDS_START = 3


def bind(host: str, port: int, hint: str = "use --port", host_hint: str = "use --host") -> socket.socket:
    """A listening, inheritable TCP socket; a bind that fails is a ConfigError that says what to change: the
    port (`hint`) when it is taken or needs privileges, the host (`host_hint`) when it is not this machine's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(bind_error(host, port, e, hint, host_hint)) from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def bind_error(host: str, port: int, e: OSError, hint: str, host_hint: str) -> str:
    """One line: what failed, and which setting to change for it."""
    what = f"cannot listen on {host}:{port}: {e.strerror or e}"
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return f"{what} ({host} is not an address of this machine); {host_hint}"
    if e.errno == errno.EADDRINUSE:
        holder = port_holder(port)
        return f"{what}{f' (held by {holder})' if holder else ''}; stop whatever holds it or {hint}"
    if e.errno == errno.EACCES:
        return f"{what} (a port below 1024 needs root or CAP_NET_BIND_SERVICE); {hint}"
    return f"{what}; {hint}"


def listening_pids(port: int) -> list[int]:
    """The processes that listen on TCP `port` (those this user may see; every process holding the socket)."""
    import psutil

    try:
        return sorted(
            {
                c.pid
                for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
            }
        )
    except (psutil.Error, OSError):
        return []


def command_line(pid: int) -> list[str]:
    import psutil

    try:
        return [str(arg) for arg in psutil.Process(pid).cmdline()]  # psutil has no type hints
    except psutil.Error:
        return []


def port_holder(port: int) -> str | None:
    """The process that listens on `port` ("pid N: its command line"), when this user may see it; else None."""
    for pid in listening_pids(port):
        return f"pid {pid}: {' '.join(command_line(pid))[:160]}"
    return None


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
