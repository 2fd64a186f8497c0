"""The TOML config file: `[engine]` (the server's flags) and `[supervisor]` (every policy threshold).

One file describes a deployment.  Keys are the flag names with dashes turned into underscores;
an unknown key is an error naming it (a typo must not silently fall back to a default).  Without a
file, built-in defaults serve the embedded model on 127.0.0.1:8000.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import ConfigError, EngineConfig
from opsctl.policy import PolicyConfig

DEFAULT_CONFIG_PATH = Path("/etc/pagekeeper/pagekeeper.toml")

# Server flags of `python -m engine.server` that are not engine flags (see engine/server/__main__.py).
SERVER_KEYS = {
    "host": "127.0.0.1", "port": 8000, "api_key": None, "admin_key": None, "disable_log_requests": False,
    "max_waiting": None, "health_stall_seconds": 30.0, "drain_timeout": 60.0, "enable_debug_hooks": False,
    "log_level": "info",
}


def default_runtime_dir() -> Path:
    env = os.environ.get("PAGEKEEPER_RUNTIME_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/run/pagekeeper")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "pagekeeper" if xdg else Path(f"/tmp/pagekeeper-{os.geteuid()}")


@dataclass(frozen=True)
class SupervisorConfig(PolicyConfig):
    """The [supervisor] section: the policy's thresholds (inherited) plus how the daemon runs."""

    poll_interval: float = 10.0
    probe_timeout: float = 5.0
    drain_timeout: float = 60.0
    dry_run: bool = False
    launcher: str = "auto"  # auto | process | systemd
    handover: str = "auto"  # auto | overlap | sequential: start the new engine before the old one leaves?
    unit: str = "pagekeeper-engine.service"
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9400  # 0 = any free port (reported in status)
    runtime_dir: str | None = None
    history_size: int = 1000

    def policy(self) -> PolicyConfig:
        return PolicyConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(PolicyConfig)})

    def runtime_path(self) -> Path:
        return Path(self.runtime_dir) if self.runtime_dir else default_runtime_dir()

    def validate(self) -> None:
        if self.launcher not in ("auto", "process", "systemd"):
            raise ConfigError(f"[supervisor] launcher must be auto, process or systemd, got {self.launcher!r}")
        if self.handover not in ("auto", "overlap", "sequential"):
            raise ConfigError(f"[supervisor] handover must be auto, overlap or sequential, got {self.handover!r}")
        for name in ("poll_interval", "probe_timeout", "hang_seconds", "event_window", "restart_window"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"[supervisor] {name} must be > 0, got {getattr(self, name)}")
        if self.max_restarts < 1 or self.events_to_act < 1:
            raise ConfigError("[supervisor] max_restarts and events_to_act must be >= 1")


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
        """The [engine] section as `python -m engine.server` flags (booleans as --x / --no-x)."""
        args: list[str] = []
        for key, value in self.engine.items():
            if value is None:
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

    def as_dict(self) -> dict[str, Any]:
        return {"engine": dict(self.engine), "supervisor": dataclasses.asdict(self.supervisor)}


def load_config(path: str | os.PathLike[str] | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> PagekeeperConfig:
    """Read the file (explicit path must exist; the default path may be absent) and apply overrides."""
    raw: dict[str, Any] = {}
    source = "built-in defaults"
    candidate = Path(path) if path else DEFAULT_CONFIG_PATH
    if candidate.exists():
        try:
            raw = tomllib.loads(candidate.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{candidate}: not valid TOML: {e}") from e
        source = str(candidate)
    elif path:
        raise ConfigError(f"--config {candidate}: no such file")
    unknown_sections = set(raw) - {"engine", "supervisor"}
    if unknown_sections:
        raise ConfigError(f"{source}: unknown section(s) {sorted(unknown_sections)}; use [engine] and [supervisor]")
    engine = {k.replace("-", "_"): v for k, v in raw.get("engine", {}).items()}
    supervisor = {k.replace("-", "_"): v for k, v in raw.get("supervisor", {}).items()}
    for section, values in (overrides or {}).items():
        (engine if section == "engine" else supervisor).update({k: v for k, v in values.items() if v is not None})

    known_engine = EngineConfig.field_names() | set(SERVER_KEYS)
    bad = sorted(set(engine) - known_engine)
    if bad:
        raise ConfigError(f"{source}: unknown [engine] key(s) {bad}")
    known_sup = {f.name for f in dataclasses.fields(SupervisorConfig)}
    bad = sorted(set(supervisor) - known_sup)
    if bad:
        raise ConfigError(f"{source}: unknown [supervisor] key(s) {bad}")
    EngineConfig.from_kwargs(**{k: v for k, v in engine.items() if k in EngineConfig.field_names()})  # validate
    sup = SupervisorConfig(**supervisor)
    sup.validate()
    return PagekeeperConfig(engine=engine, supervisor=sup, source=source)
