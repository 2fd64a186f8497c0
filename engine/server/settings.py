"""The server's own settings (not the engine's): where it listens, keys, admission and drain limits.

Defined once with their types and ranges, so that `python -m engine.server` flags and the `[engine]`
section of the TOML config file (opsctl/config.py) refuse the same mistakes with the same words.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from engine.config import ConfigError
from engine.ops_contract.secrets import read_secret

_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def check_host(host: str) -> str:
    """An IPv4 or IPv6 address, or a host name (RFC 1123 labels, the last one not all digits): `999.1.1.1` is
    refused here, with the key named, rather than when the engine binds, where a failed lookup read as a port
    problem.  Whether a name resolves is for the bind to say: a name may resolve only where the engine runs."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    if len(host) <= 253 and all(_LABEL.match(label) for label in labels) and not labels[-1].isdigit():
        return host
    raise ValueError("not an IPv4 or IPv6 address or a host name")


Host = Annotated[str, Field(min_length=1), AfterValidator(check_host)]

# Flags opsctl sets for the engines it starts; not settings a config file may hold.
INTERNAL_FIELDS = ("listen_fd", "control_socket", "inflight_file", "share_cores_with", "config")


@dataclass
class ServerConfig:
    host: Host = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    api_key: str | None = None
    admin_key: str | None = None
    api_key_file: Annotated[str, Field(min_length=1)] | None = None
    admin_key_file: Annotated[str, Field(min_length=1)] | None = None
    disable_log_requests: bool = False
    max_waiting: Annotated[int, Field(ge=1)] | None = None
    health_stall_seconds: Annotated[float, Field(gt=0, le=86400)] = 30.0
    drain_timeout: Annotated[float, Field(ge=0, le=86400)] = 60.0
    enable_debug_hooks: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    max_request_body_bytes: Annotated[int, Field(ge=1024)] = 32 * 2**20
    max_connections: Annotated[int, Field(ge=8)] | None = None  # None: the open-file limit less a reserve
    header_timeout: Annotated[float, Field(gt=0, le=3600)] = 10.0
    metrics_names: Literal["vllm", "seed", "both"] = "both"  # engine/server/metrics.py says why both by default
    chat_template: Annotated[str, Field(min_length=1)] | None = None  # a file, or the template itself
    enable_auto_tool_choice: bool = False
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    disable_log_stats: bool = False
    disable_fastapi_docs: bool = False  # no /docs, /redoc, /openapi.json (vLLM's flag)
    cpu_reserved_cores: Annotated[int, Field(ge=0)] | None = None  # None: 1 on a CPU engine with >= 2 cores
    engine_core: Literal["thread", "process"] = "process"  # engine/loop/: a core may die without its requests
    max_resumes: Annotated[int, Field(ge=0, le=100)] = 3  # times one request is handed to a new core
    resume_timeout: Annotated[float, Field(gt=0, le=86400)] = 300.0  # seconds one request may wait for a new core
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "warning"
    listen_fd: int | None = None
    control_socket: str | None = None
    inflight_file: str | None = None
    share_cores_with: Annotated[int, Field(ge=1)] | None = None  # the engine a handover runs beside
    config: str | None = None


def resolve_key_files(server: ServerConfig) -> ServerConfig:
    """Read --api-key-file / --admin-key-file into the keys (a key given both ways is a mistake)."""
    for key, file_key, flag in (
        ("api_key", "api_key_file", "--api-key-file"),
        ("admin_key", "admin_key_file", "--admin-key-file"),
    ):
        path = getattr(server, file_key)
        if path is None:
            continue
        if getattr(server, key) is not None:
            raise ConfigError(
                f"{flag} and --{key.replace('_', '-')} (or its environment variable) both give the key; keep one"
            )
        setattr(server, key, read_secret(path, flag))
    return server
