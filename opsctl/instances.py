"""Several deployments on one host: an instance name scopes everything two deployments could share.

An instance owns a runtime dir (`pagekeeper` for the default instance, `pagekeeper@NAME` beside it for a
named one: siblings, never nested, so that systemd's RuntimeDirectory= cleanup of one cannot remove
another's sockets), the control sockets and logs in it, its systemd units (`pagekeeper-engine@NAME`) and
its default config file (`/etc/pagekeeper/NAME.toml`).  Each running supervisor records in
`instance.json` which ports it uses, so that a second instance asked to use one of them is refused
with a line naming the instance that has it, instead of a bind error or, worse, a shared socket.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from opsctl.constants import INSTANCE_FILE_NAME

if TYPE_CHECKING:  # opsctl.config imports this module
    from opsctl.config import PagekeeperConfig

DEFAULT_INSTANCE = "default"
INSTANCE_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"
CONFIG_DIR = Path("/etc/pagekeeper")


def _dir_name(instance: str) -> str:
    return "pagekeeper" if instance == DEFAULT_INSTANCE else f"pagekeeper@{instance}"


def runtime_dir_for(instance: str = DEFAULT_INSTANCE) -> Path:
    """Where an instance keeps its sockets, pid file and logs, unless configured otherwise.

    PAGEKEEPER_RUNTIME_DIR names one instance's dir exactly (it wins); PAGEKEEPER_RUNTIME_ROOT the
    directory that holds every instance's dir; otherwise root uses /run, a user $XDG_RUNTIME_DIR,
    else /tmp with the uid in the name.
    """
    env = os.environ.get("PAGEKEEPER_RUNTIME_DIR")
    if env:
        return Path(env)
    name = _dir_name(instance)
    root = os.environ.get("PAGEKEEPER_RUNTIME_ROOT")
    if root:
        return Path(root) / name
    if os.geteuid() == 0:
        return Path("/run") / name
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / name
    return Path("/tmp") / (f"pagekeeper-{os.geteuid()}" + ("" if instance == DEFAULT_INSTANCE else f"@{instance}"))


def config_path_for(instance: str) -> Path:
    """The config file a named instance reads when no --config is given (the systemd template's %i.toml)."""
    return CONFIG_DIR / ("pagekeeper.toml" if instance == DEFAULT_INSTANCE else f"{instance}.toml")


def engine_unit_for(instance: str) -> str:
    return "pagekeeper-engine.service" if instance == DEFAULT_INSTANCE else f"pagekeeper-engine@{instance}.service"


@dataclass(frozen=True)
class InstanceRecord:
    """What a running supervisor claims: written at start, removed at exit (stale ones are ignored)."""

    instance: str
    config: str
    supervisor_pid: int
    runtime_dir: str
    host: str
    port: int
    metrics_host: str
    metrics_port: int


def instance_record(cfg: PagekeeperConfig, runtime: Path, metrics_port: int, pid: int | None = None) -> InstanceRecord:
    """What this instance claims (ports), as other instances' starts read it from `instance.json`."""
    return InstanceRecord(
        instance=cfg.supervisor.instance,
        config=cfg.source,
        supervisor_pid=pid or os.getpid(),
        runtime_dir=str(runtime),
        host=cfg.host,
        port=cfg.port,
        metrics_host=cfg.supervisor.metrics_host,
        metrics_port=metrics_port,
    )


def write_record(runtime: Path, record: InstanceRecord) -> None:
    from opsctl.runtime import write_private

    write_private(runtime / INSTANCE_FILE_NAME, json.dumps(asdict(record)))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process


def running_instances(near: Path) -> list[InstanceRecord]:
    """The live instances whose runtime dirs sit beside `near` (the default layout puts them all there)."""
    records = []
    prefix = near.name.split("@", 1)[0]
    try:
        candidates = sorted(near.parent.glob(f"{prefix}*"))
    except OSError:
        return []
    for d in candidates:
        try:
            raw = json.loads((d / INSTANCE_FILE_NAME).read_text())
            record = InstanceRecord(**raw)
        except (OSError, ValueError, TypeError):
            continue
        if pid_alive(record.supervisor_pid):
            records.append(record)
    return records


def _runtime_dir_of(argv: list[str]) -> Path | None:
    """The runtime dir a pagekeeper process belongs to, from its command line: a supervisor's --runtime-dir, an
    engine's control socket (which opsctl puts in the runtime dir)."""
    for flag, of in (("--runtime-dir", Path), ("--control-socket", lambda v: Path(v).parent)):
        if flag in argv[:-1]:
            return of(argv[argv.index(flag) + 1])
    return None


def instance_holding(port: int) -> str | None:
    """Which pagekeeper instance listens on `port` (its supervisor holds the engine's socket, its engines share it):
    "instance 'x' (runtime dir D, config C, supervisor pid P)", or None when no pagekeeper process of this user does.
    Instances whose runtime dirs are not siblings (each given its own --runtime-dir) do not see each other's
    instance.json, so a clash on the port is found from the process that holds it."""
    from engine.ops_contract.sockets import command_line, listening_pids

    for pid in listening_pids(port):
        runtime = _runtime_dir_of(command_line(pid))
        if runtime is None:
            continue
        try:
            record = InstanceRecord(**json.loads((runtime / INSTANCE_FILE_NAME).read_text()))
        except (OSError, ValueError, TypeError):
            return f"the pagekeeper instance with runtime dir {runtime} (pid {pid})"
        return (
            f"instance {record.instance!r} (runtime dir {runtime}, config {record.config}, "
            f"supervisor pid {record.supervisor_pid})"
        )
    return None


def _same_address(a: str, b: str) -> bool:
    wildcard = ("", "0.0.0.0", "::")
    return a == b or a in wildcard or b in wildcard


def port_clash(mine: InstanceRecord, others: list[InstanceRecord]) -> str | None:
    """One line naming the instance that already uses a port this one wants, or None."""
    for other in others:
        if Path(other.runtime_dir) == Path(mine.runtime_dir) or other.supervisor_pid == mine.supervisor_pid:
            continue
        wants = [
            ("[engine] port", mine.host, mine.port, other.host, other.port),
            ("[engine] port", mine.host, mine.port, other.metrics_host, other.metrics_port),
            ("[supervisor] metrics_port", mine.metrics_host, mine.metrics_port, other.host, other.port),
            ("[supervisor] metrics_port", mine.metrics_host, mine.metrics_port, other.metrics_host, other.metrics_port),
        ]
        for key, host, port, other_host, other_port in wants:
            if port and port == other_port and _same_address(host, other_host):
                return (
                    f"{key} {port} is already used by instance {other.instance!r} (config {other.config}, "
                    f"supervisor pid {other.supervisor_pid}); give instance {mine.instance!r} another {key}"
                    + (" (0 = any free port)" if key.startswith("[supervisor]") else "")
                )
    return None
