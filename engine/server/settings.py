"""The server's own settings (not the engine's): where it listens, keys, admission and drain limits.

Defined once with their types and ranges, so that `python -m engine.server` flags and the `[engine]`
section of the TOML config file (opsctl/config.py) refuse the same mistakes with the same words.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

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


def _flag(help_text: str, default: Any = None, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help_text, **extra})


@dataclass
class ServerConfig:
    """The server's flags (`--host` ...), also the [engine] section's keys beside the engine's: one definition,
    checked by one schema (engine/schema.py) as it is built, whether from flags or from the config file."""

    host: Host = _flag("Bind address (default loopback only).", "127.0.0.1")
    port: Annotated[int, Field(ge=1, le=65535)] = _flag("Port to listen on.", 8000)
    api_key: str | None = _flag("Require 'Authorization: Bearer KEY' on /v1/* and /tokenize (env PAGEKEEPER_API_KEY).")
    admin_key: str | None = _flag("Key for /drain from non-loopback clients (env PAGEKEEPER_ADMIN_KEY).")
    api_key_file: Annotated[str, Field(min_length=1)] | None = _flag(
        "Read the API key from this file (mode 0600): keys on a command line are visible to any local user."
    )
    admin_key_file: Annotated[str, Field(min_length=1)] | None = _flag("Read the admin key from this file (mode 0600).")
    disable_log_requests: bool = _flag("Do not log each HTTP request.", False)
    max_waiting: Annotated[int, Field(ge=1)] | None = _flag(
        "Most requests waiting to be scheduled; beyond it, 429 with Retry-After."
    )
    health_stall_seconds: Annotated[float, Field(gt=0, le=86400)] = _flag(
        "/health says 'stalled' when work waits and the step loop has not advanced this long.", 30.0
    )
    drain_timeout: Annotated[float, Field(ge=0, le=86400)] = _flag(
        "On SIGTERM, wait this long for in-flight requests before exiting.", 60.0
    )
    enable_debug_hooks: bool = _flag("Enable /debug/* test hooks (tests only).", False)
    log_level: Literal["debug", "info", "warning", "error"] = _flag("The server's log level.", "info")
    max_request_body_bytes: Annotated[int, Field(ge=1024)] = _flag(
        "Larger request bodies get 413 before they are read (default 32 MiB).", 32 * 2**20
    )
    max_connections: Annotated[int, Field(ge=8)] | None = _flag(
        "Open connections at most; beyond it the longest-idle one is closed to make room "
        "(default: the open-file limit less 100)."
    )
    header_timeout: Annotated[float, Field(gt=0, le=3600)] = _flag(
        "Seconds a connection may take to send a complete request head before it is closed.", 10.0
    )
    metrics_names: Literal["vllm", "seed", "both"] = _flag(  # engine/server/metrics.py says why both by default
        "Names /metrics exports: vllm (vLLM's, vllm:num_requests_waiting, as vLLM dashboards, production-stack "
        "and KEDA triggers query), seed (the seed's underscore forms, vllm_num_requests_waiting), or both (default).",
        "both",
    )
    chat_template: Annotated[str, Field(min_length=1)] | None = _flag(
        "The chat template (Jinja) to use instead of the model's: a file, or the template itself."
    )
    enable_auto_tool_choice: bool = _flag(
        'Let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser.', False
    )
    tool_call_parser: Literal["hermes", "llama3_json"] | None = _flag(
        "How the model writes tool calls: hermes (<tool_call> tags: Hermes, Qwen2.5, Qwen3) or llama3_json."
    )
    disable_log_stats: bool = _flag(
        "Do not log the throughput / queue / KV cache line every 10 s while there is work.", False
    )
    disable_fastapi_docs: bool = _flag(
        "Serve no /docs, /redoc or /openapi.json (they need no API key): for a server reachable by others.", False
    )
    cpu_reserved_cores: Annotated[int, Field(ge=0)] | None = _flag(
        "CPU engine: cores kept for HTTP, tokenizing and detokenizing; the model's threads run on the rest "
        "(default 1 when the process may use 4 or more cores, else 0: nothing kept)."
    )
    engine_core: Literal["thread", "process"] = _flag(  # engine/loop/: a core may die without its requests
        "Where the model runs: in a process of its own (process, the default): when that process dies "
        "(killed, a fatal device error, a hang), this one starts a new one and resumes every request in flight on "
        "it, streams included (engine/loop/); or on a thread of this process (thread).",
        "process",
    )
    max_resumes: Annotated[int, Field(ge=0, le=100)] = _flag(
        "--engine-core process: how many times one request is handed to a new engine core before it fails "
        "with a retryable 503 (default 3).",
        3,
    )
    resume_timeout: Annotated[float, Field(gt=0, le=86400)] = _flag(
        "--engine-core process: seconds a request may wait for a new engine core after its own ended before "
        "it fails with a retryable 503 (default 300).",
        300.0,
    )
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = _flag(
        "uvicorn's own log level (default warning: requests are logged by pagekeeper itself).", "warning"
    )
    # Set by opsctl for the engines it starts (INTERNAL_FIELDS): not config-file keys.
    listen_fd: int | None = _flag("Serve on this inherited listening socket instead of binding (opsctl passes one).")
    control_socket: str | None = _flag(
        "Serve the supervisor's private control channel on this unix socket (opsctl sets it)."
    )
    inflight_file: str | None = _flag(
        "Publish the count of requests in flight in this file (opsctl sets it, to count what a crash cost)."
    )
    share_cores_with: Annotated[int, Field(ge=1)] | None = _flag(
        "Run half the model's CPU threads until process PID (the engine this one replaces) has exited "
        "(opsctl sets it on an overlapping handover; engine/core_share.py says why).",
        metavar="PID",
    )
    config: str | None = _flag(
        "Take flags from the [engine] section of this pagekeeper TOML file (the file opsctl "
        "and the systemd unit use); flags given on the command line win."
    )

    def __post_init__(self) -> None:
        from engine.schema import check_settings

        check_settings(self)

    @staticmethod
    def check_combinations(server: Any) -> None:
        """What one key's range cannot say (engine/schema.py runs it), in flag terms."""
        if server.engine_core == "thread":  # a core in this process is never resumed: its bounds would do nothing
            for key in ("max_resumes", "resume_timeout"):
                if getattr(server, key) != ServerConfig.__dataclass_fields__[key].default:
                    flag = "--" + key.replace("_", "-")
                    raise ConfigError(
                        f"{flag} bounds the resumes of --engine-core process; this server runs --engine-core thread"
                    )
        if server.enable_auto_tool_choice and server.tool_call_parser is None:
            raise ConfigError(
                "--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json): the format the model "
                "writes its tool calls in"
            )


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
