"""The supervisor's Prometheus exporter: its metric definitions and the HTTP server that serves them.

Kept apart from the daemon's loop so that the metric contract (docs/architecture.md: `pagekeeper_supervisor_*` and
the NVML readings as `pagekeeper_gpu_*`) is one short file that the alert rules' tests can load without
starting anything (tests/alerts/test_rules.py).  Every labelled series exists from the start, so that
`increase()` sees the first restart of each kind.

The same port answers `GET /livez` for a kubelet's liveness probe: 200 while the supervisor's loop runs and
has not given up, 503 otherwise (the daemon's `liveness()` decides).  It says nothing about the engine:
restarting a sick engine is the supervisor's job, and a probe on the engine would have the kubelet restart
the whole container for what the supervisor already handles (docs/kubernetes.md).
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable, Iterator, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.config import ConfigError
from opsctl.constants import ENGINE_LOG_NAME, SUPERVISOR_LOG_NAME
from opsctl.policy import EFFECTS
from opsctl.probes import GpuReading

log = structlog.get_logger("pagekeeper.supervisor")


class GpuSource(Protocol):
    """Whatever holds the last poll's NVML readings (the supervisor)."""

    last_gpu: list[GpuReading]


# GpuReading field -> the gauge it is exported as (per GPU, label `gpu`); `read_gpu_metrics` reads them back.
GPU_GAUGES = {
    "memory_used_bytes": ("pagekeeper_gpu_memory_used_bytes", "GPU memory used (NVML)"),
    "memory_total_bytes": ("pagekeeper_gpu_memory_total_bytes", "GPU memory total (NVML)"),
    "utilization_ratio": ("pagekeeper_gpu_utilization_ratio", "GPU utilization 0-1 (NVML)"),
    "temperature_celsius": ("pagekeeper_gpu_temperature_celsius", "GPU temperature (NVML)"),
}


class _GpuCollector:
    """Exports the latest NVML readings at scrape time (values come from the last poll)."""

    def __init__(self, source: GpuSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        readings: list[GpuReading] = self.source.last_gpu
        fams = {key: GaugeMetricFamily(name, doc, labels=["gpu"]) for key, (name, doc) in GPU_GAUGES.items()}
        xid = CounterMetricFamily("pagekeeper_gpu_xid_errors", "Critical XID events seen (NVML)", labels=["gpu"])
        ecc = CounterMetricFamily("pagekeeper_gpu_ecc_errors", "Uncorrected volatile ECC errors (NVML)", labels=["gpu"])
        for g in readings:
            if g.ecc_errors_total is not None:
                ecc.add_metric([str(g.index)], float(g.ecc_errors_total))
            for key, fam in fams.items():
                value = getattr(g, key)
                if value is not None:
                    fam.add_metric([str(g.index)], float(value))
            xid.add_metric([str(g.index)], float(g.xid_errors_total))
        yield from fams.values()
        yield xid
        yield ecc


def read_gpu_metrics(text: str) -> list[GpuReading]:
    """The GPUs in a supervisor's /metrics text (what Prometheus scrapes), by index; names are not exported ("").
    ValueError if the text is not Prometheus."""
    from prometheus_client.parser import text_string_to_metric_families

    by_name = {name: key for key, (name, _) in GPU_GAUGES.items()} | {"pagekeeper_gpu_xid_errors_total": "xid"}
    gpus: dict[int, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = by_name.get(sample.name)
            if key and "gpu" in sample.labels:
                gpus.setdefault(int(sample.labels["gpu"]), {})[key] = sample.value
    readings = []
    for index, values in sorted(gpus.items()):
        readings.append(
            GpuReading(
                index=index,
                name="",
                memory_used_bytes=int(values.get("memory_used_bytes", 0)),
                memory_total_bytes=int(values.get("memory_total_bytes", 0)),
                utilization_ratio=values.get("utilization_ratio"),
                temperature_celsius=values.get("temperature_celsius"),
                xid_errors_total=int(values.get("xid", 0)),
            )
        )
    return readings


# (action, reason) pairs the policy can decide (opsctl/policy.py).
ACTIONS = tuple((effect.kind, reason) for reason, effect in EFFECTS.items())
LOST_REASONS = ("engine_exited", "killed", "no_drain")


class SupervisorMetrics:
    """The supervisor's own series (`pagekeeper_supervisor_*`, `pagekeeper_gpu_*`), in a registry of their own."""

    def __init__(self, source: GpuSource) -> None:
        self.registry = r = CollectorRegistry()
        self.engine_up = Gauge("pagekeeper_supervisor_engine_up", "1 while the engine answers /health", registry=r)
        self.restarts = Counter(
            "pagekeeper_supervisor_restarts", "Engine restarts by the supervisor", ["reason"], registry=r
        )
        self.decisions = Counter(
            "pagekeeper_supervisor_decisions", "Acting decisions (also in dry-run)", ["action", "reason"], registry=r
        )
        self.recycles = Counter(
            "pagekeeper_supervisor_recycles",
            "In-place recycles of the engine's KV pool (the cheap cure: no restart, no request lost)",
            ["reason"],
            registry=r,
        )
        self.gave_up = Gauge(
            "pagekeeper_supervisor_crash_loop_gave_up", "1 after the crash-loop guard gave up", registry=r
        )
        self.last_restart = Gauge(
            "pagekeeper_supervisor_last_restart_timestamp_seconds", "Unix time of the last restart", registry=r
        )
        self.scrape_ok = Gauge(
            "pagekeeper_supervisor_engine_metrics_ok", "1 when the last engine /metrics parsed", registry=r
        )
        self.nvml = Gauge("pagekeeper_supervisor_nvml_available", "1 when NVML readings are available", registry=r)
        self.polls = Counter("pagekeeper_supervisor_polls", "Polls of the engine", registry=r)
        self.lost = Counter(
            "pagekeeper_supervisor_requests_lost",
            "Requests in flight that got no answer: the "
            "engine died (engine_exited), was killed after its drain timeout (killed), or was "
            "restarted with --no-drain (no_drain: answered with a clean 503)",
            ["reason"],
            registry=r,
        )
        self.log_rotations = Counter(
            "pagekeeper_supervisor_log_rotations",
            "Size-based rotations of the process launcher's logs ([supervisor] log_max_bytes)",
            ["log"],
            registry=r,
        )
        self.info = Gauge(
            "pagekeeper_supervisor_info",
            "The engine this supervisor runs (always 1)",
            ["model_name", "engine_url", "launcher"],
            registry=r,
        )
        # Every series exists from the start, so increase() sees the first restart of each kind.
        for action, reason in ACTIONS:
            self.decisions.labels(action, reason)
        for reason in {reason for kind, reason in ACTIONS if kind not in ("give_up", "recycle")} | {"manual"}:
            self.restarts.labels(reason)
        for reason in {reason for kind, reason in ACTIONS if kind == "recycle"}:
            self.recycles.labels(reason)
        for reason in LOST_REASONS:
            self.lost.labels(reason)
        for name in (ENGINE_LOG_NAME, SUPERVISOR_LOG_NAME):
            self.log_rotations.labels(name)
        r.register(_GpuCollector(source))


# liveness() -> (alive, one line saying why)
Liveness = Callable[[], tuple[bool, str]]
LIVENESS_PATH = "/livez"


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - a probe every few seconds is no news
        pass


def _app(metrics: SupervisorMetrics, liveness: Liveness | None) -> Callable[..., Iterable[bytes]]:
    """/livez from `liveness`, everything else prometheus_client's exposition (as start_http_server serves it)."""
    exposition = make_wsgi_app(metrics.registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == LIVENESS_PATH and liveness is not None:
            alive, why = liveness()
            body = (why + "\n").encode()
            start_response(
                "200 OK" if alive else "503 Service Unavailable",
                [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))],
            )
            return [body]
        return exposition(environ, start_response)

    return app


def serve(metrics: SupervisorMetrics, host: str, port: int, liveness: Liveness | None = None) -> int:
    """Serve /metrics (and /livez) on host:port (0: any free port) from a thread; the port it got.  A port that
    is taken is a mistake a person fixes in the config: ConfigError, not a traceback."""

    class Server(_Server):
        address_family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]

    try:
        server = make_server(host, port, _app(metrics, liveness), Server, handler_class=_QuietHandler)
    except OSError as e:
        raise ConfigError(
            f"[supervisor] metrics_port {port} on {host}: {e.strerror}; choose another port (0 = any free port)"
        ) from e
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    bound = int(server.server_port)
    log.info("supervisor_metrics", url=f"http://{host}:{bound}/metrics")
    return bound
