"""What `opsctl status` shows: the supervisor builds a `Status`, the control socket carries it as JSON, the
CLI reads it back into a `Status`.

One typed shape on both sides, so that a field the daemon renames breaks here (and in the tests), not in a
key lookup in the CLI.  The JSON is the contract automation reads (`opsctl status --json`): `to_json` keeps
its keys, their order and their values exactly, and `from_json(to_json(s)) == s`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from opsctl.probes import GpuReading, ProcessReading
from opsctl.state import EngineState


@dataclass
class EngineStatus:
    state: EngineState
    health: str
    health_detail: str | None
    pid: int | None
    uptime_s: float | None
    url: str
    model: str | None
    kv_cache_usage: float | None
    running: int | None
    waiting: int | None
    oldest_waiting_s: float | None
    steps_total: int | None
    metrics_error: str | None
    process: ProcessReading | None
    last_exit: str | None
    readings_age_s: float | None = None  # how old the figures above are: the last poll's (None: no poll yet)
    core_restarts: int | None = None  # engine cores restarted behind the front (engine/loop/), every reason
    requests_resumed: int | None = None  # in-flight requests the front handed to a new core


@dataclass
class GpuStatus:
    available: bool
    detail: str
    devices: list[GpuReading] = field(default_factory=list)


@dataclass
class Decision:
    """The policy's last decision (acting or not), as logged."""

    action: str
    reason: str
    evidence: dict[str, Any]
    time: float
    dry_run: bool


@dataclass
class RestartRecord:
    time: float
    decided_at: float
    reason: str
    lost: int  # requests in flight that got no answer


@dataclass
class RestartsStatus:
    total: int
    recent: list[RestartRecord]
    counted_for_crash_loop: int


@dataclass
class CrashLoopStatus:
    gave_up: bool
    reason: str | None
    permanent: bool
    max_restarts: int
    restart_window_s: float


@dataclass
class SupervisorStatus:
    pid: int
    launcher: str
    dry_run: bool
    uptime_s: float
    metrics_url: str
    config: str
    instance: str
    runtime_dir: str
    poll_interval_s: float
    handover: str  # overlap | standby | sequential (opsctl/launcher.py)
    weights_keeper: dict[str, Any] | None = None  # pid, state, load_seconds, starts (opsctl/keeper.py); None: none
    spare_engine: dict[str, Any] | None = None  # pid, state of the engine standing by (opsctl/launcher.py); None: none


@dataclass
class Status:
    engine: EngineStatus
    gpu: GpuStatus
    last_decision: Decision | None
    restarts: RestartsStatus
    crash_loop: CrashLoopStatus
    supervisor: SupervisorStatus
    engine_log: str | None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["engine"]["state"] = self.engine.state.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Status:
        """Read a supervisor's reply; ValueError when it is not a status this opsctl understands."""
        try:
            e, g, d, r = data["engine"], data["gpu"], data["last_decision"], data["restarts"]
            engine = EngineStatus(
                **{
                    **e,
                    "state": EngineState(e["state"]),
                    "process": ProcessReading(**e["process"]) if e["process"] else None,
                }
            )
            return cls(
                engine=engine,
                gpu=GpuStatus(**{**g, "devices": [GpuReading(**x) for x in g["devices"]]}),
                last_decision=Decision(**d) if d is not None else None,
                restarts=RestartsStatus(**{**r, "recent": [RestartRecord(**x) for x in r["recent"]]}),
                crash_loop=CrashLoopStatus(**data["crash_loop"]),
                supervisor=SupervisorStatus(**data["supervisor"]),
                engine_log=data["engine_log"],
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a status this opsctl reads ({exc!r}); is the supervisor another version?") from exc


def no_gpu_line(detail: str) -> str:
    """Why no GPU is shown, plainly: a machine without NVIDIA's driver is a CPU machine, not an error."""
    if "LibraryNotFound" in detail or "Shared Library Not Found" in detail or "DriverNotLoaded" in detail:
        return "none (no NVIDIA driver on this machine: the engine runs on the CPU)"
    return f"not readable: {detail}"
