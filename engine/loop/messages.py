"""What the front and the core say to each other: plain data, pickled over a local socket pair.

Front to core: Start (once), then Admit / Finish / Recycle / YieldCores / Fault.  Core to front: PhaseChanged
while it starts, Ready or Refused (once), then Stepped after every step (and about four times a second while
idle: silence means a hung core), Recycled.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.admission import ValidRequest
from engine.core.deltas import SeqDelta
from engine.core.facts import CoreFacts, RecycleReport
from engine.cpu_threads import CpuThreadPlan
from engine.stats import EngineSnapshot


@dataclass(frozen=True)
class Start:
    config: EngineConfig
    log_level: str = "info"
    cpu_reserved_cores: int | None = None  # a CPU engine: cores left to the front (engine/cpu_threads.py)
    share_cores_with: int | None = None  # half the threads until this process exits (engine/core_share.py)


@dataclass(frozen=True)
class YieldCores:
    """The engine hands over to a successor that serves: keep the other half of the cores (engine/core_share.py)."""


@dataclass(frozen=True)
class Admit:
    request_id: str
    valid: ValidRequest
    arrival: float  # the front's time.monotonic() (one host: the same clock)
    resumed: dict[int, list[int]] | None = None  # sequence index -> tokens it produced under a core that died


@dataclass(frozen=True)
class Finish:
    seq_id: str
    status: str  # a RequestStatus value
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class Recycle:
    pass


@dataclass(frozen=True)
class Fault:
    """Test hook (--enable-debug-hooks): "exit" dies at once, "fatal" raises in the next step as a device error
    would, "leak" holds `blocks` KV blocks leaving `leave` free (engine/server/debug_hooks.py)."""

    kind: str
    blocks: int = 0
    leave: int = 0


@dataclass(frozen=True)
class Ready:
    facts: CoreFacts
    pid: int
    cpu_plan: CpuThreadPlan | None = None  # a CPU engine: the cores it computes on, and those left to the front


@dataclass(frozen=True)
class PhaseChanged:
    """The starting core moved between loading and standby (engine/lifecycle.py): the front, which the supervisor
    asks, answers the same."""

    phase: str


@dataclass(frozen=True)
class Refused:
    """The core cannot start as configured (a ConfigError): one line, and the front exits 2 with it."""

    message: str


@dataclass
class Stepped:
    deltas: list[SeqDelta]
    snapshot: EngineSnapshot
    leaked: int = 0  # blocks the leak hook holds


@dataclass
class Recycled:
    deltas: list[SeqDelta]
    report: RecycleReport
