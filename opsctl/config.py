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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from engine.config import ConfigError
from engine.ops_contract.config_file import write_engine_section
from engine.schema import validate_section
from engine.server.config_file import SECTIONS, SERVER_KEYS, read_config_file, validate_engine_section
from engine.server.settings import Host
from opsctl.instances import DEFAULT_INSTANCE, INSTANCE_PATTERN, config_path_for, engine_unit_for, runtime_dir_for
from opsctl.policy import PolicyConfig


@dataclass(frozen=True)
class SupervisorConfig(PolicyConfig):
    """The [supervisor] section: the policy's thresholds (inherited) plus how the daemon runs."""

    poll_interval: Annotated[float, Field(gt=0, le=3600)] = 10.0
    probe_timeout: Annotated[float, Field(gt=0, le=600)] = 5.0
    drain_timeout: Annotated[float, Field(ge=0, le=86400)] = 60.0
    dry_run: bool = False
    launcher: Literal["auto", "process", "systemd"] = "auto"
    handover: Literal["auto", "overlap", "sequential"] = "auto"  # new engine first, then the old one leaves?
    # The weights keeper (engine/keeper/, opsctl/keeper.py): auto = on when the engine runs on a GPU with the process
    # launcher (a restart then maps the kept weights instead of reloading them), off on the CPU.
    keep_weights: Literal["auto", "on", "off"] = "auto"
    # A spare engine standing by behind the serving one (imports done, kept weights mapped, no KV cache): when the
    # engine dies or is restarted, the spare takes the GPU at its exit.  auto = on where weights are kept and one
    # engine runs at a time (a GPU); it costs a CUDA context per GPU and the host memory of one more process.
    spare_engine: Literal["auto", "on", "off"] = "auto"
    # Engines' compiled bytecode (opsctl/bytecode.py): auto = where the installation keeps none and may not write any
    # (PYTHONDONTWRITEBYTECODE, a read-only install), engines keep theirs under the cache folder; off = leave it.
    bytecode_cache: Literal["auto", "off"] = "auto"
    instance: Annotated[str, Field(pattern=INSTANCE_PATTERN)] = DEFAULT_INSTANCE
    unit: Annotated[str, Field(pattern=r"^[A-Za-z0-9:_.@\\-]+\.service$")] | None = None  # None: from the instance
    metrics_host: Host = "127.0.0.1"
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 9400  # 0 = any free port (reported in status)
    runtime_dir: Annotated[str, Field(min_length=1)] | None = None
    history_size: Annotated[int, Field(ge=2, le=10_000_000)] | None = None  # None: enough for every window
    # Process launcher: engine.log and supervisor.log are rotated (copy, then truncate) past this size.
    log_max_bytes: Annotated[int, Field(ge=4096, le=2**40)] = 100 * 2**20
    log_backups: Annotated[int, Field(ge=0, le=100)] = 3
    # A container's log: the engine's log lines are echoed to stdout as JSON (opsctl/logecho.py) and the supervisor
    # logs JSON to stdout too, so that the container runtime collects both; engine.log is still written and rotated.
    log_to_stdout: bool = False

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

    @staticmethod
    def check_combinations(config: Any) -> None:
        """What one key's range cannot say: combinations that would blind a rule or be ignored (engine/schema.py
        runs it with the section's schema)."""
        if config.launcher == "systemd" and config.handover == "overlap":
            raise ConfigError(
                '[supervisor] handover = "overlap" needs the process launcher: systemd runs one '
                "engine unit at a time (its socket unit queues connections meanwhile); use "
                'handover = "auto" or launcher = "process"'
            )
        if config.launcher == "systemd" and config.keep_weights == "on":
            raise ConfigError(
                '[supervisor] keep_weights = "on" needs the process launcher: the systemd unit starts the engine '
                'with fixed flags; use keep_weights = "auto" (off under systemd) or launcher = "process"'
            )
        if config.spare_engine == "on" and (config.launcher == "systemd" or config.handover == "overlap"):
            raise ConfigError(
                '[supervisor] spare_engine = "on" needs the process launcher and one engine at a time '
                '(handover "auto" on a GPU, or "sequential"): a spare waits for the serving engine to exit'
            )
        needed, kept = SupervisorConfig.history_needed(config), config.history_size
        if kept is not None and kept < needed:
            raise ConfigError(
                f"[supervisor] history_size = {kept} keeps {kept * config.poll_interval:.0f} s "
                f"of polls, shorter than the longest rule window; use at least {needed} "
                "(or leave it out: the default covers every window)"
            )


@dataclass
class PagekeeperConfig:
    engine: dict[str, Any] = field(default_factory=dict)  # flags for `python -m engine.server`
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    source: str = "built-in defaults"
    engine_from_command_line: tuple[str, ...] = ()  # [engine] keys `opsctl start --model/--port/--host` gave
    supervisor_from_command_line: tuple[str, ...] = ()  # [supervisor] keys opsctl's flags gave (--runtime-dir, ...)
    keys_in_file: dict[str, tuple[str, ...]] = field(default_factory=dict)  # section -> the keys the file sets

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

    def engine_command_line(self, section_file: Path) -> list[str]:
        """How the engines the supervisor starts (and its weights keeper) get the [engine] section: what the file
        set, as checked here, written to `section_file` and read back with `--config` by the same schema (no flag
        is built from it: engine/ops_contract/config_file.py); what `opsctl start --model/--port/--host` gave, as
        those flags.  So an engine's error names each value where the person gave it."""
        from_file = {
            k: self.engine[k] for k in self.keys_in_file.get("engine", ()) if k not in self.engine_from_command_line
        }
        args = ["--config", str(write_engine_section(section_file, from_file))] if from_file else []
        for key in self.engine_from_command_line:  # str and int values: the flags as `opsctl start` took them
            args += ["--" + key.replace("_", "-"), str(self.engine[key])]
        return args

    def as_dict(self) -> dict[str, Any]:
        return {"engine": dict(self.engine), "supervisor": dataclasses.asdict(self.supervisor)}


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: dict[str, dict[str, Any]] | None = None
) -> PagekeeperConfig:
    """Read the file (explicit path must exist; the default path may be absent) and apply overrides."""
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    source = "built-in defaults"
    instance = (overrides or {}).get("supervisor", {}).get("instance")
    candidate = Path(path) if path else config_path_for(instance or DEFAULT_INSTANCE)
    if candidate.exists():
        sections = read_config_file(candidate)
        source = str(candidate.resolve())  # one file, however it was named (start compares them)
    elif path:
        raise ConfigError(f"--config {candidate}: no such file")
    engine, supervisor = sections["engine"], sections["supervisor"]
    in_file = {name: tuple(values) for name, values in sections.items()}
    for section, values in (overrides or {}).items():
        (engine if section == "engine" else supervisor).update({k: v for k, v in values.items() if v is not None})
    given = tuple(k for k, v in (overrides or {}).get("engine", {}).items() if v is not None)
    given_supervisor = tuple(k for k, v in (overrides or {}).get("supervisor", {}).items() if v is not None)
    engine = validate_engine_section(engine, source)
    supervisor = validate_section(SupervisorConfig, supervisor, source, "supervisor")
    return PagekeeperConfig(
        engine=engine,
        supervisor=SupervisorConfig(**supervisor),
        source=source,
        engine_from_command_line=given,
        supervisor_from_command_line=given_supervisor,
        keys_in_file=in_file,
    )
