"""What the supervisor looks at: the engine's /health and /metrics, the GPU (NVML), the process.

Every probe returns a reading or says plainly why it has none; none of them raises into the
supervisor's loop, because a monitoring daemon that dies on a bad scrape is worse than none.
Metrics are parsed with prometheus_client's own text parser, so labels, escaping and exemplars
are handled (the seed sidecar split lines on spaces and broke on the first label).

httpx (which imports rich for its own command line) and the parser are imported at the first probe, not with this
module: `opsctl` only reads the readings' types from here, and the supervisor spawns the engine before it first
probes it, so neither process pays for them before the engine starts (benchmarks/opsctl_start.py).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import psutil
import structlog

if TYPE_CHECKING:
    import httpx

log = structlog.get_logger("pagekeeper.supervisor")

# Engine metrics the policy, the status and `opsctl top` read (base names, see engine/server/metrics.py), summed over
# their label sets.  An engine exports vLLM's names (vllm:x), the seed's (vllm_x) or both (--metrics-names); each
# field is read from the first name present in this order, so that an engine exporting both is not counted twice.
WANTED_BASES = {
    "cache_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "running": ("num_requests_running",),
    "waiting": ("num_requests_waiting",),
    "swapped": ("num_requests_swapped",),
    "steps_total": ("engine_steps_total",),
    "allocator_efficiency": ("gpu_allocator_efficiency",),
    "draining": ("engine_draining",),
    "token_utilization": ("kv_cache_token_utilization",),
    "preemptions": ("num_preemptions_total",),
    "oldest_waiting_s": ("oldest_waiting_seconds",),
    # counters `opsctl top` turns into rates
    "generation_tokens": ("generation_tokens_total",),
    "prompt_tokens": ("prompt_tokens_total",),
    "requests_finished": ("request_success_total",),
    # the engine core's own process (engine/loop/): its restarts behind the front and the requests it resumed
    "core_restarts": ("engine_core_restarts_total",),
    "requests_resumed": ("requests_resumed_total",),
}
# Histograms `opsctl top` reads percentiles from (their _bucket series, by upper bound), under the same rule.
HISTOGRAM_BASES = {
    "ttft": "time_to_first_token_seconds",
    "tpot": "request_time_per_output_token_seconds",
}
_PREFIXES = ("vllm:", "vllm_")
WANTED = {key: tuple(prefix + base for prefix in _PREFIXES for base in bases) for key, bases in WANTED_BASES.items()}
_WANTED_NAMES = {name for names in WANTED.values() for name in names}
HISTOGRAMS = {key: tuple(prefix + base + "_bucket" for prefix in _PREFIXES) for key, base in HISTOGRAM_BASES.items()}
_HISTOGRAM_NAMES = {name for names in HISTOGRAMS.values() for name in names}
_SCRAPED_NAMES = _WANTED_NAMES | _HISTOGRAM_NAMES
# Asked of the engine's /metrics: only these series (`name[]`, as Prometheus' client libraries filter).  All of an
# engine's series took 10 ms of its front's CPU per scrape (76 KB), every poll (docs/decisions/metrics-scrape.md);
# an engine that ignores the parameter answers everything, which _wanted_lines filters here as before.  The
# supervisor's poll reads no histogram (POLL_PARAMS); `opsctl top` reads two (SCRAPE_PARAMS).
POLL_PARAMS = {"name[]": sorted(_WANTED_NAMES)}
SCRAPE_PARAMS = {"name[]": sorted(_SCRAPED_NAMES)}


@dataclass
class EngineReading:
    health: str  # ok | draining | stalled | unreachable | timeout | error
    health_detail: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    metrics_error: str | None = None
    model_name: str | None = None


class EngineProbe:
    def __init__(self, url: str, timeout: float, admin_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        # /drain needs the admin key once the engine has an API key (loopback alone is not trusted then)
        self.admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}

    @functools.cached_property
    def client(self) -> httpx.Client:
        import httpx

        return httpx.Client(timeout=self.timeout)

    def read(self) -> EngineReading:
        import httpx

        health, detail = self._health()
        reading = EngineReading(health=health, health_detail=detail)
        if health in ("unreachable", "timeout"):
            reading.metrics_error = f"engine {health}"
            return reading
        try:
            text = self.client.get(self.url + "/metrics", params=POLL_PARAMS).text
            reading.metrics, reading.model_name = parse_engine_metrics(text)
        except httpx.TimeoutException:
            reading.metrics_error = "metrics endpoint timed out"
        except httpx.HTTPError as e:
            reading.metrics_error = f"metrics request failed: {e}"
        except ValueError as e:
            reading.metrics_error = f"unparseable metrics: {e}"
        return reading

    def _health(self) -> tuple[str, str]:
        import httpx

        try:
            r = self.client.get(self.url + "/health")
        except httpx.TimeoutException:
            return "timeout", "no answer within the probe timeout"
        except httpx.HTTPError as e:
            return "unreachable", str(e) or type(e).__name__
        try:
            status = r.json().get("status", "")
        except ValueError:
            status = ""
        if r.status_code == 200:
            return "ok", status
        if status in ("draining", "stalled"):
            return status, f"HTTP {r.status_code}"
        return "error", f"HTTP {r.status_code}"

    def drain(self, timeout: float) -> dict[str, Any]:
        """A load balancer's drain over HTTP (the systemd launcher; the process launcher uses the engine's control
        socket): the engine answers 503 to new requests until resumed."""
        return self._admin("POST", {"timeout": timeout}, timeout + 10)

    def recycle(self, timeout: float) -> dict[str, Any]:
        """Rebuild the engine's KV pool in place, over HTTP (when the launcher has no private channel to it)."""
        r = self.client.post(self.url + "/recycle", timeout=timeout + 10, headers=self.admin_headers)
        if r.status_code == 409:  # not serving (draining, leaving): OpenAI's error shape
            return {"ok": False, "error": r.json().get("error", {}).get("message", r.text)}
        r.raise_for_status()
        return dict(r.json())

    def resume(self) -> dict[str, Any]:
        return self._admin("DELETE", {}, self.client.timeout.read or 10)

    def _admin(self, method: str, params: dict[str, Any], timeout: float) -> dict[str, Any]:
        """/drain with the admin key; a refusal or a failure is one RuntimeError line that says what to change."""
        import httpx

        try:
            r = self.client.request(
                method, self.url + "/drain", params=params, timeout=timeout, headers=self.admin_headers
            )
        except httpx.HTTPError as e:
            raise RuntimeError(f"{method} /drain failed: {type(e).__name__}: {e}") from None
        if r.status_code in (401, 403):
            raise RuntimeError(
                f"the engine refused {method} /drain (HTTP {r.status_code}): under systemd the supervisor drains "
                "it over HTTP, which with [engine] api_key set needs the admin key too: set [engine] admin_key_file "
                "(or PAGEKEEPER_ADMIN_KEY in /etc/pagekeeper/engine.env)"
            )
        if r.status_code != 200:
            raise RuntimeError(f"{method} /drain answered HTTP {r.status_code}: {r.text.strip()[:200]}")
        return r.json()

    def close(self) -> None:
        if "client" in self.__dict__:  # never probed: no client was made
            self.client.close()


def parse_engine_metrics(text: str) -> tuple[dict[str, float], str | None]:
    """{policy field: value} for the engine metrics we use; ValueError if the text is not Prometheus."""
    scrape = scrape_engine_metrics(text)
    if not scrape.values:
        raise ValueError("none of the engine metrics the supervisor needs (vllm:* or vllm_*) are present")
    return scrape.values, scrape.model


@dataclass
class EngineScrape:
    """One /metrics text, read once: the wanted values, the wanted histograms and the model's name."""

    values: dict[str, float]
    histograms: dict[str, dict[float, float]]  # key -> {bucket upper bound (inf last): cumulative count}
    model: str | None


def _wanted_lines(text: str) -> str:
    """The sample lines of `text` whose series is one of WANTED or HISTOGRAMS (comments and the rest left out)."""
    kept = []
    for line in text.splitlines():
        if line and line[0] != "#" and line.split("{", 1)[0].split(" ", 1)[0].rstrip() in _SCRAPED_NAMES:
            kept.append(line)
    return "\n".join(kept) + "\n"


def scrape_engine_metrics(text: str) -> EngineScrape:
    """The values of WANTED and the buckets of HISTOGRAMS in `text`, each summed over its label sets (a histogram
    per upper bound); ValueError if the text is not Prometheus.  Only the lines of those series reach the parser:
    all of an engine's 76 KB took 34 ms of CPU, every poll of a supervisor, every second of `opsctl top`."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    model = None
    for family in text_string_to_metric_families(_wanted_lines(text)):
        for sample in family.samples:
            if sample.name in _WANTED_NAMES:
                sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
            elif sample.name in _HISTOGRAM_NAMES and "le" in sample.labels:
                per_bound = buckets.setdefault(sample.name, {})
                bound = float(sample.labels["le"])
                per_bound[bound] = per_bound.get(bound, 0.0) + float(sample.value)
            else:
                continue
            model = sample.labels.get("model_name", model)
    values = {}
    for key, names in WANTED.items():
        found = next((name for name in names if name in sums), None)
        if found is not None:
            values[key] = sums[found]
    histograms = {}
    for key, names in HISTOGRAMS.items():
        found = next((name for name in names if name in buckets), None)
        if found is not None:
            histograms[key] = dict(sorted(buckets[found].items()))
    return EngineScrape(values, histograms, model)


# -- GPU ---------------------------------------------------------------------------------------


@dataclass
class GpuReading:
    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_ratio: float | None
    temperature_celsius: float | None
    xid_errors_total: int = 0
    ecc_errors_total: int | None = None


class GpuProbe(Protocol):
    available: bool
    reason: str  # why not available, or the driver version when it is

    def read(self) -> list[GpuReading]: ...


class NvmlGpuProbe:
    """The real NVML (pynvml).  No NVML on the machine is a normal state, reported once."""

    def __init__(self) -> None:
        self.available = False
        self.reason = ""
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._events: Any = None
        self._xids: dict[int, int] = {}
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._xids = {i: 0 for i in range(count)}
            self.reason = f"driver {_text(pynvml.nvmlSystemGetDriverVersion())}, {count} GPU(s)"
            self.available = True
            self._register_xid_events()
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.reason = f"NVML unavailable: {type(e).__name__}: {e}".rstrip(": ")
        log.info("nvml", available=self.available, detail=self.reason)

    def _register_xid_events(self) -> None:
        n = self._nvml
        try:
            self._events = n.nvmlEventSetCreate()
            for h in self._handles:
                n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, self._events)
        except Exception as e:
            self._events = None
            log.info("nvml_xid_events_unavailable", error=str(e))

    def read(self) -> list[GpuReading]:
        if not self.available:
            return []
        n = self._nvml
        self._drain_xid_events()
        out = []
        for i, h in enumerate(self._handles):
            mem = n.nvmlDeviceGetMemoryInfo(h)
            out.append(
                GpuReading(
                    index=i,
                    name=_text(n.nvmlDeviceGetName(h)),
                    memory_used_bytes=int(mem.used),
                    memory_total_bytes=int(mem.total),
                    utilization_ratio=_maybe(lambda: n.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
                    temperature_celsius=_maybe(lambda: float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))),
                    xid_errors_total=self._xids.get(i, 0),
                    ecc_errors_total=_maybe(
                        lambda: int(
                            n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC)
                        )
                    ),
                )
            )
        return out

    def _drain_xid_events(self) -> None:
        if self._events is None:
            return
        n = self._nvml
        while True:
            try:
                event = n.nvmlEventSetWait(self._events, 0)
            except Exception:
                return  # NVML_ERROR_TIMEOUT: no more events
            for i, h in enumerate(self._handles):
                if event.device == h:
                    self._xids[i] = self._xids.get(i, 0) + 1
                    log.warning("gpu_xid_error", gpu=i, xid=int(event.eventData))


class FakeGpuProbe:
    """Stands in for NVML on machines without a GPU; reads GpuReadings from a JSON file.

    Same interface as NvmlGpuProbe, selected with PAGEKEEPER_FAKE_NVML=<file>; the file is re-read
    every poll so a test can change the readings while the supervisor runs.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.available = True
        self.reason = f"fake NVML from {path}"

    def read(self) -> list[GpuReading]:
        try:
            with open(self.path) as f:
                return [GpuReading(**g) for g in json.load(f)]
        except (OSError, ValueError, TypeError) as e:
            log.warning("fake_nvml_unreadable", path=self.path, error=str(e))
            return []


def gpu_probe() -> GpuProbe:
    fake = os.environ.get("PAGEKEEPER_FAKE_NVML")
    return FakeGpuProbe(fake) if fake else NvmlGpuProbe()


def _maybe(read: Any) -> Any:
    try:
        return read()
    except Exception:
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- the process --------------------------------------------------------------------------------


@dataclass
class ProcessReading:
    alive: bool
    pid: int | None = None
    status: str = "absent"
    rss_bytes: int | None = None  # the engine and every process under it (its engine core, tensor-parallel ranks)
    cpu_percent: float | None = None
    core_pid: int | None = None  # the engine core's process under the engine (engine/loop/); None: one process


CORE_MODULE = "engine.loop"  # what the engine core's command line runs (`python -m engine.loop`)


class ProcessProbe:
    def __init__(self) -> None:
        self._proc: psutil.Process | None = None

    @staticmethod
    def _tree(proc: psutil.Process) -> tuple[int, int | None]:
        """Resident memory of `proc` and the processes under it (an engine whose core runs in a process of its
        own, engine/loop/, holds most of its memory there), and the pid of that core (None: none)."""
        total = proc.memory_info().rss
        cores: list[tuple[float, int]] = []
        for child in proc.children(recursive=True):
            try:
                total += child.memory_info().rss
                if CORE_MODULE in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                    cores.append((child.create_time(), child.pid))
            except psutil.Error:
                pass  # gone between the listing and the reading
        # the serving core is the oldest: a spare standing by behind it (engine/loop/remote.py) starts after it
        return total, min(cores)[1] if cores else None

    def read(self, pid: int | None) -> ProcessReading:
        if pid is None:
            return ProcessReading(alive=False)
        try:
            if self._proc is None or self._proc.pid != pid:
                self._proc = psutil.Process(pid)
                self._proc.cpu_percent(None)  # prime the CPU counter
            status = self._proc.status()
            alive = self._proc.is_running() and status != psutil.STATUS_ZOMBIE
            rss, core_pid = self._tree(self._proc)
            return ProcessReading(
                alive=alive,
                pid=pid,
                status=status,
                rss_bytes=rss,
                cpu_percent=self._proc.cpu_percent(None),
                core_pid=core_pid,
            )
        except psutil.Error:
            return ProcessReading(alive=False, pid=pid, status="gone")
