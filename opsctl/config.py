"""The TOML config file: `[engine]` (the server's flags) and `[supervisor]` (every policy threshold).

One file describes a deployment.  Keys are the flag names with dashes turned into underscores.
Every key has a type and a range, checked by one pydantic schema built from the dataclasses that
use the values (EngineConfig, ServerConfig, SupervisorConfig), strictly: `dry_run = "no"` is an
error, not a truthy string; an unknown key is an error naming it.  Each mistake is one line that
names the key, the value and what is allowed (opsctl and the engine exit 2 on it).  Without a file,
built-in defaults serve the embedded model on 127.0.0.1:8000.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from engine.config import ConfigError, EngineConfig
from engine.schema import validate_section
from engine.server.settings import INTERNAL_FIELDS, ServerConfig
from opsctl.instances import DEFAULT_INSTANCE, INSTANCE_PATTERN, config_path_for, engine_unit_for, runtime_dir_for
from opsctl.policy import PolicyConfig

DEFAULT_CONFIG_PATH = config_path_for(DEFAULT_INSTANCE)

# Keys never put on a command line, and the environment variables the server reads them from.
SECRET_ENV = {"api_key": "PAGEKEEPER_API_KEY", "admin_key": "PAGEKEEPER_ADMIN_KEY"}

# Server flags of `python -m engine.server` that are not engine flags, with their defaults.
SERVER_KEYS = {f.name: f.default for f in dataclasses.fields(ServerConfig) if f.name not in INTERNAL_FIELDS}


@dataclass(frozen=True)
class SupervisorConfig(PolicyConfig):
    """The [supervisor] section: the policy's thresholds (inherited) plus how the daemon runs."""

    poll_interval: Annotated[float, Field(gt=0, le=3600)] = 10.0
    probe_timeout: Annotated[float, Field(gt=0, le=600)] = 5.0
    drain_timeout: Annotated[float, Field(ge=0, le=86400)] = 60.0
    dry_run: bool = False
    launcher: Literal["auto", "process", "systemd"] = "auto"
    handover: Literal["auto", "overlap", "sequential"] = "auto"  # new engine first, then the old one leaves?
    instance: Annotated[str, Field(pattern=INSTANCE_PATTERN)] = DEFAULT_INSTANCE
    unit: Annotated[str, Field(pattern=r"^[A-Za-z0-9:_.@\\-]+\.service$")] | None = None  # None: from the instance
    metrics_host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 9400  # 0 = any free port (reported in status)
    runtime_dir: Annotated[str, Field(min_length=1)] | None = None
    history_size: Annotated[int, Field(ge=2, le=10_000_000)] | None = None  # None: enough for every window
    # Process launcher: engine.log and supervisor.log are rotated (copy, then truncate) past this size.
    log_max_bytes: Annotated[int, Field(ge=4096, le=2**40)] = 100 * 2**20
    log_backups: Annotated[int, Field(ge=0, le=100)] = 3

    def policy(self) -> PolicyConfig:
        return PolicyConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(PolicyConfig)})

    def runtime_path(self) -> Path:
        return Path(self.runtime_dir) if self.runtime_dir else runtime_dir_for(self.instance)

    def engine_unit(self) -> str:
        return self.unit or engine_unit_for(self.instance)

    def history_needed(self) -> int:
        """Observations that span the longest window a rule looks back over, at this poll interval."""
        longest = max(self.event_window, self.hang_seconds, self.fragmentation_window)
        return math.ceil(longest / self.poll_interval) + 2

    def history_len(self) -> int:
        return self.history_size if self.history_size is not None else self.history_needed()

    def validate(self) -> None:
        """What one key's range cannot say: combinations that would blind a rule or be ignored."""
        if self.launcher == "systemd" and self.handover == "overlap":
            raise ConfigError("[supervisor] handover = \"overlap\" needs the process launcher: systemd runs one "
                              "engine unit at a time (its socket unit queues connections meanwhile); use "
                              "handover = \"auto\" or launcher = \"process\"")
        if self.history_size is not None and self.history_size < self.history_needed():
            raise ConfigError(
                f"[supervisor] history_size = {self.history_size} keeps {self.history_size * self.poll_interval:.0f} s "
                f"of polls, shorter than the longest rule window; use at least {self.history_needed()} "
                "(or leave it out: the default covers every window)")


@dataclass
class PagekeeperConfig:
    engine: dict[str, Any] = field(default_factory=dict)  # flags for `python -m engine.server`
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    source: str = "built-in defaults"

    @property
    def host(self) -> str:
        return str(self.engine.get("host", SERVER_KEYS["host"]))

    @property
    def port(self) -> int:
        return int(self.engine.get("port", SERVER_KEYS["port"]))

    @property
    def engine_url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def engine_args(self) -> list[str]:
        """The [engine] section as `python -m engine.server` flags (booleans as --x / --no-x), secrets excluded:
        any local user can read a command line (`ps`), so keys travel in the environment (`engine_env`)."""
        args: list[str] = []
        for key, value in self.engine.items():
            if value is None or key in SECRET_ENV:
                continue
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                if key in SERVER_KEYS:  # server booleans are store_true flags
                    if value:
                        args.append(flag)
                else:
                    args.append(flag if value else "--no-" + key.replace("_", "-"))
            else:
                args.extend([flag, str(value)])
        return args

    def engine_env(self) -> dict[str, str]:
        """The secrets of the [engine] section as the environment variables the server reads."""
        return {env: str(self.engine[key]) for key, env in SECRET_ENV.items() if self.engine.get(key)}

    def as_dict(self) -> dict[str, Any]:
        return {"engine": dict(self.engine), "supervisor": dataclasses.asdict(self.supervisor)}


def load_config(path: str | os.PathLike[str] | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> PagekeeperConfig:
    """Read the file (explicit path must exist; the default path may be absent) and apply overrides."""
    raw: dict[str, Any] = {}
    source = "built-in defaults"
    instance = (overrides or {}).get("supervisor", {}).get("instance")
    candidate = Path(path) if path else config_path_for(instance or DEFAULT_INSTANCE)
    if candidate.exists():
        try:
            raw = tomllib.loads(candidate.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{candidate}: not valid TOML: {e}") from e
        source = str(candidate.resolve())  # one file, however it was named (start compares them)
    elif path:
        raise ConfigError(f"--config {candidate}: no such file")
    unknown_sections = set(raw) - {"engine", "supervisor"}
    if unknown_sections:
        raise ConfigError(f"{source}: unknown section(s) {sorted(unknown_sections)}; use [engine] and [supervisor]")
    for section in ("engine", "supervisor"):
        if not isinstance(raw.get(section, {}), dict):
            raise ConfigError(f"{source}: [{section}] must be a table of keys")
    engine = {k.replace("-", "_"): v for k, v in raw.get("engine", {}).items()}
    supervisor = {k.replace("-", "_"): v for k, v in raw.get("supervisor", {}).items()}
    for section, values in (overrides or {}).items():
        (engine if section == "engine" else supervisor).update({k: v for k, v in values.items() if v is not None})

    server_part = {k: v for k, v in engine.items() if k in SERVER_KEYS}
    engine_part = {k: v for k, v in engine.items() if k not in SERVER_KEYS}
    unknown = sorted(set(engine_part) - EngineConfig.field_names())
    if unknown:
        known = ", ".join(sorted(EngineConfig.field_names() | set(SERVER_KEYS)))
        raise ConfigError(f"{source}: unknown key [engine] {unknown[0]!r}; known keys: {known}")
    server_part = validate_section(ServerConfig, server_part, f"{source}: [engine]", exclude=INTERNAL_FIELDS)
    engine_part = validate_section(EngineConfig, engine_part, f"{source}: [engine]")
    try:
        EngineConfig.from_kwargs(**engine_part)  # the engine's own ranges and combinations
    except ConfigError as e:  # its messages name flags; in a file the keys are what a person edits
        keys = re.sub(r"--([a-z0-9-]+)", lambda m: m.group(1).replace("-", "_"), str(e))
        raise ConfigError(f"{source}: [engine] {keys}") from None
    supervisor = validate_section(SupervisorConfig, supervisor, f"{source}: [supervisor]")
    sup = SupervisorConfig(**supervisor)
    try:
        sup.validate()
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return PagekeeperConfig(engine={**server_part, **engine_part}, supervisor=sup, source=source)
