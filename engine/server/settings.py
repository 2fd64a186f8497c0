"""The server's own settings (not the engine's): where it listens, keys, admission and drain limits.

Defined once with their types and ranges, so that `python -m engine.server` flags and the `[engine]`
section of the TOML config file (opsctl/config.py) refuse the same mistakes with the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

# Flags opsctl sets for the engines it starts; not settings a config file may hold.
INTERNAL_FIELDS = ("listen_fd", "control_socket", "inflight_file", "config")


@dataclass
class ServerConfig:
    host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    api_key: str | None = None
    admin_key: str | None = None
    disable_log_requests: bool = False
    max_waiting: Annotated[int, Field(ge=1)] | None = None
    health_stall_seconds: Annotated[float, Field(gt=0, le=86400)] = 30.0
    drain_timeout: Annotated[float, Field(ge=0, le=86400)] = 60.0
    enable_debug_hooks: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    max_request_body_bytes: Annotated[int, Field(ge=1024)] = 32 * 2**20
    max_connections: Annotated[int, Field(ge=8)] | None = None  # None: the open-file limit less a reserve
    header_timeout: Annotated[float, Field(gt=0, le=3600)] = 10.0
    listen_fd: int | None = None
    control_socket: str | None = None
    inflight_file: str | None = None
    config: str | None = None
