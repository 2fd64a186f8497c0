"""The figures `opsctl top` shows, from what Prometheus scrapes: the engine's /metrics, the supervisor's /metrics
(`pagekeeper_gpu_*`) and the supervisor's status (state, decisions, restarts) over its control socket.

Gauges are shown as read.  Counters become rates, and histograms percentiles, over the window between two
scrapes (cumulative counts subtracted, as Prometheus' rate() and histogram_quantile() do): a figure says what
happened in the last refresh, not since the engine started.  Rendering lives apart (opsctl/top_view.py), so
that these figures are computed and tested without a terminal.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opsctl import control
from opsctl.exporter import read_gpu_metrics
from opsctl.probes import SCRAPE_PARAMS, EngineScrape, GpuReading, scrape_engine_metrics
from opsctl.state import EngineState
from opsctl.status import Status, no_gpu_line

if TYPE_CHECKING:
    import httpx

QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
RECENT_DECISIONS = 5


@dataclass
class Sample:
    """One instance at one moment: its status, its engine's metrics and its GPUs (each None or empty when absent,
    with `error` saying why)."""

    at: float  # time.monotonic() when the engine's metrics arrived
    status: Status | None
    engine: EngineScrape | None
    gpus: list[GpuReading] = field(default_factory=list)
    error: str | None = None


@dataclass
class Latency:
    """Percentiles (seconds) of the observations made in the window, and how many there were (0: all None)."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    count: int = 0


@dataclass
class DecisionLine:
    time: float  # Unix time
    text: str  # "restart (hang), 0 lost", "none (healthy)"


@dataclass
class Figures:
    instance: str
    state: str
    model: str | None = None
    url: str | None = None
    running: int | None = None
    waiting: int | None = None
    kv_cache_usage: float | None = None  # 0-1
    generation_tokens_per_s: float | None = None
    prompt_tokens_per_s: float | None = None
    requests_per_s: float | None = None  # finished successfully
    ttft: Latency = field(default_factory=Latency)
    tpot: Latency = field(default_factory=Latency)
    window_s: float | None = None  # what the rates and percentiles cover (None: one scrape so far)
    gpus: list[GpuReading] = field(default_factory=list)
    gpu_detail: str | None = None  # why no GPU is shown
    decisions: list[DecisionLine] = field(default_factory=list)  # newest first
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """histogram_quantile(q) of cumulative bucket counts {upper bound: count} (+Inf last): linear within the bucket
    the rank falls in; the highest finite bound when it falls in +Inf; None without observations."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def window_buckets(previous: dict[float, float] | None, current: dict[float, float]) -> dict[float, float]:
    """The observations between two scrapes of one histogram; a counter that went back (the engine restarted)
    started again from zero, so all of the current one is new."""
    if not previous:
        return dict(current)
    delta = {bound: count - previous.get(bound, 0.0) for bound, count in current.items()}
    return dict(current) if any(v < 0 for v in delta.values()) else delta


def rate(previous: float | None, current: float | None, seconds: float) -> float | None:
    if previous is None or current is None or seconds <= 0:
        return None
    return (current - previous if current >= previous else current) / seconds


def latency(previous: EngineScrape, current: EngineScrape, key: str) -> Latency:
    if key not in current.histograms:
        return Latency()
    window = window_buckets(previous.histograms.get(key), current.histograms[key])
    count = int(round(window[max(window)])) if window else 0
    if count <= 0:
        return Latency()
    return Latency(**{name: quantile(q, window) for name, q in QUANTILES.items()}, count=count)


def compute(instance: str, previous: Sample | None, current: Sample, decisions: list[DecisionLine]) -> Figures:
    """The figures of one instance from its last two samples (rates and percentiles need both)."""
    st = current.status
    if st is None:
        return Figures(instance, str(EngineState.NOT_RUNNING), error=current.error, decisions=decisions)
    figures = Figures(
        instance,
        str(st.engine.state),
        model=st.engine.model,
        url=st.engine.url,
        gpus=current.gpus,
        gpu_detail=None if current.gpus else no_gpu_line(st.gpu.detail) if not st.gpu.available else "no readings",
        decisions=decisions,
        error=current.error,
    )
    scrape = current.engine
    if scrape is None:
        return figures
    values = scrape.values
    figures.model = scrape.model or figures.model
    for key, name in (("running", "running"), ("waiting", "waiting")):
        if key in values:
            setattr(figures, name, int(values[key]))
    figures.kv_cache_usage = values.get("cache_usage")
    before = previous.engine if previous is not None else None
    if before is None or previous is None:
        return figures
    seconds = current.at - previous.at
    figures.window_s = round(seconds, 3)
    for key, name in (
        ("generation_tokens", "generation_tokens_per_s"),
        ("prompt_tokens", "prompt_tokens_per_s"),
        ("requests_finished", "requests_per_s"),
    ):
        setattr(figures, name, rate(before.values.get(key), values.get(key), seconds))
    figures.ttft = latency(before, scrape, "ttft")
    figures.tpot = latency(before, scrape, "tpot")
    return figures


def recent_decisions(seen: list[DecisionLine], status: Status | None) -> list[DecisionLine]:
    """The supervisor's last decision, added to `seen` when it changed, merged with its recent restarts; newest
    first.  The status carries one decision (remade every poll), so a change is a new action or reason."""
    if status is None:
        return sorted(seen, key=lambda d: d.time, reverse=True)[:RECENT_DECISIONS]
    d = status.last_decision
    if d is not None:
        text = f"{d.action} ({d.reason})" + (" [dry run]" if d.dry_run else "")
        if not seen or seen[-1].text != text:
            seen.append(DecisionLine(d.time, text))
            del seen[:-RECENT_DECISIONS]
    restarts = [
        DecisionLine(r.decided_at, f"restart ({r.reason})" + (f", {r.lost} request(s) lost" if r.lost else ""))
        for r in status.restarts.recent
    ]
    return sorted([*seen, *restarts], key=lambda d: d.time, reverse=True)[:RECENT_DECISIONS]


class Watcher:
    """One instance: reads a sample per refresh and keeps what its figures need from the one before."""

    def __init__(self, instance: str, runtime: Path, timeout: float) -> None:
        self.instance = instance
        self.runtime = runtime
        self.timeout = timeout
        self.previous: Sample | None = None
        self.seen: list[DecisionLine] = []
        self._client: httpx.Client | None = None

    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            import httpx

            self._client = httpx.Client(timeout=self.timeout)
        return self._client

    def sample(self) -> Sample:
        import httpx

        try:
            st = control.read_status(self.runtime)
        except (control.SupervisorNotRunning, OSError, ValueError) as e:
            return Sample(time.monotonic(), None, None, error=f"the supervisor is not running ({e})")
        sample = Sample(time.monotonic(), st, None)
        try:
            names = {g.index: g.name for g in st.gpu.devices}  # the metrics do not carry them
            sample.gpus = read_gpu_metrics(self.client.get(st.supervisor.metrics_url).text)
            for g in sample.gpus:
                g.name = names.get(g.index, "")
        except (httpx.HTTPError, ValueError):
            sample.gpus = []  # the status still says why (no NVML), and the engine's figures matter more
        if st.engine.state in (EngineState.EXITED, EngineState.NOT_RUNNING) or st.engine.state.gave_up:
            sample.error = f"engine {st.engine.state}"
            return sample
        try:
            text = self.client.get(st.engine.url.rstrip("/") + "/metrics", params=SCRAPE_PARAMS).text
            sample.at = time.monotonic()
            sample.engine = scrape_engine_metrics(text)
        except httpx.HTTPError as e:
            sample.error = f"engine metrics: {type(e).__name__}: {e}".rstrip(": ")
        except ValueError as e:
            sample.error = f"engine metrics unparseable: {e}"
        return sample

    def step(self) -> Figures:
        current = self.sample()
        figures = compute(self.instance, self.previous, current, recent_decisions(self.seen, current.status))
        if current.engine is not None or current.status is None:
            self.previous = current  # a failed scrape keeps the last good one as the window's start
        return figures

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
