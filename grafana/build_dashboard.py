"""Writes grafana/pagekeeper.json, the pagekeeper Grafana dashboard (classic JSON model, schemaVersion 39).

    python3 grafana/build_dashboard.py          # rewrite grafana/pagekeeper.json
    python3 grafana/build_dashboard.py --check  # exit 1 if the JSON is not what this script writes

The panels are defined here once, so ids and grid positions stay consistent; tests/alerts/ checks that the
committed JSON matches this script, type-checks it against Grafana's schema (grafana/typecheck/) and runs every
query against a real Prometheus scraping a real engine and supervisor. Edit here, not in the JSON (a dashboard
changed in Grafana's UI can be exported and its changes brought back here).

Queries follow the metric contract in docs/architecture.md: engine series by vLLM's names (`vllm:*`, exported unless the
engine runs with --metrics-names seed) carry `model_name` (variable $model_name); supervisor and NVML series carry
the supervisor's `instance` (variable $supervisor).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "pagekeeper.json"

DS = {"type": "prometheus", "uid": "${datasource}"}
M = 'model_name=~"$model_name"'  # engine series
S = 'instance=~"$supervisor"'  # supervisor and NVML series
RATE = "$__rate_interval"


class Layout:
    """Hands out panel ids and grid positions, row by row (Grafana's grid is 24 columns wide)."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.row_height = 0

    def next_id(self) -> int:
        return len(self.panels) + 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "type": "row",
                "id": self.next_id(),
                "title": title,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
            }
        )
        self.y += 1

    def add(self, panel: dict[str, Any], w: int, h: int) -> None:
        if self.x + w > 24:
            self._newline()
        panel["id"] = self.next_id()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_height = max(self.row_height, h)

    def _newline(self) -> None:
        self.y += self.row_height
        self.x = 0
        self.row_height = 0


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DS, "editorMode": "code", "expr": expr, "legendFormat": legend, "range": True, "refId": ref}


def targets(*pairs: tuple[str, str]) -> list[dict[str, Any]]:
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(pairs)]


def thresholds(*steps: tuple[str, float | None]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for color, value in steps]}


BASE = thresholds(("green", None))


def timeseries(
    title: str,
    description: str,
    tgts: list[dict[str, Any]],
    unit: str,
    *,
    min_: float | None = 0,
    max_: float | None = None,
    steps: dict[str, Any] | None = None,
    threshold_style: str = "off",
    draw: str = "line",
    interpolation: str = "linear",
    overrides: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "color": {"mode": "palette-classic"},
        "custom": {
            "drawStyle": draw,
            "lineInterpolation": interpolation,
            "lineWidth": 1,
            "fillOpacity": 10,
            "gradientMode": "none",
            "showPoints": "never",
            "pointSize": 4,
            "spanNulls": False,
            "axisPlacement": "auto",
            "axisBorderShow": False,
            "stacking": {"mode": "none", "group": "A"},
            "thresholdsStyle": {"mode": threshold_style},
        },
        "thresholds": steps or BASE,
        "unit": unit,
    }
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": tgts,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {
                "calcs": ["lastNotNull", "max"],
                "displayMode": "table",
                "placement": "bottom",
                "showLegend": True,
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(
    title: str,
    description: str,
    tgts: list[dict[str, Any]],
    unit: str,
    *,
    steps: dict[str, Any] | None = None,
    mappings: list[dict[str, Any]] | None = None,
    no_value: str | None = None,
    graph: str = "none",
) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "color": {"mode": "thresholds"},
        "thresholds": steps or BASE,
        "unit": unit,
        "mappings": mappings or [],
    }
    if no_value is not None:
        defaults["noValue"] = no_value
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": tgts,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "orientation": "auto",
            "textMode": "value_and_name",
            "colorMode": "background",
            "graphMode": graph,
            "justifyMode": "auto",
            "wideLayout": True,
            "showPercentChange": False,
            "percentChangeColorMode": "standard",
        },
    }


def states(*pairs: tuple[str, str, str]) -> list[dict[str, Any]]:
    """Value mappings: (value, text, color)."""
    return [
        {
            "type": "value",
            "options": {
                value: {"text": text, "color": color, "index": i} for i, (value, text, color) in enumerate(pairs)
            },
        }
    ]


def quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum by (model_name, le) (rate({metric}_bucket{{{M}}}[{RATE}])))"


def quantiles(metric: str) -> list[dict[str, Any]]:
    return targets(*[(quantile(q, metric), f"p{round(q * 100)} {{{{model_name}}}}") for q in (0.5, 0.9, 0.99)])


def right_axis(ref: str, unit: str) -> dict[str, Any]:
    return {
        "matcher": {"id": "byFrameRefID", "options": ref},
        "properties": [{"id": "custom.axisPlacement", "value": "right"}, {"id": "unit", "value": unit}],
    }


def build() -> dict[str, Any]:
    g = Layout()

    g.row("Overview")
    g.add(
        timeseries(
            "Requests running / waiting / swapped",
            "Scheduler queues (vllm:num_requests_*). Waiting more than 3x running for 5 minutes is VLLMQueueBacklog.",
            targets(
                (f"sum by (model_name) (vllm:num_requests_running{{{M}}})", "running {{model_name}}"),
                (f"sum by (model_name) (vllm:num_requests_waiting{{{M}}})", "waiting {{model_name}}"),
                (f"sum by (model_name) (vllm:num_requests_swapped{{{M}}})", "swapped {{model_name}}"),
            ),
            "short",
        ),
        w=8,
        h=8,
    )
    g.add(
        timeseries(
            "Throughput (tokens/s)",
            "Prompt tokens processed and tokens generated per second.",
            targets(
                (
                    f"sum by (model_name) (rate(vllm:generation_tokens_total{{{M}}}[{RATE}]))",
                    "generated {{model_name}}",
                ),
                (f"sum by (model_name) (rate(vllm:prompt_tokens_total{{{M}}}[{RATE}]))", "prompt {{model_name}}"),
            ),
            "short",
        ),
        w=8,
        h=8,
    )
    g.add(
        timeseries(
            "Finished and failed requests (req/s)",
            "vllm:request_success_total by finished_reason (stop, length, abort) and vllm:request_failure_total by "
            "reason (rejected = 429/503 at admission, invalid = 400, error = engine step failure).",
            targets(
                (
                    f"sum by (model_name, finished_reason) (rate(vllm:request_success_total{{{M}}}[{RATE}]))",
                    "{{finished_reason}} {{model_name}}",
                ),
                (
                    f"sum by (model_name, reason) (rate(vllm:request_failure_total{{{M}}}[{RATE}]))",
                    "failed: {{reason}} {{model_name}}",
                ),
            ),
            "reqps",
        ),
        w=8,
        h=8,
    )

    g.row("Latency")
    g.add(
        timeseries(
            "Time to first token",
            "p50 / p90 / p99 of vllm:time_to_first_token_seconds. "
            "The alert SLO: p99 above 2 s for 10 minutes (VLLMHighTimeToFirstToken).",
            quantiles("vllm:time_to_first_token_seconds"),
            "s",
            steps=thresholds(("green", None), ("red", 2)),
            threshold_style="dashed",
        ),
        w=6,
        h=8,
    )
    g.add(
        timeseries(
            "Inter-token latency",
            "p50 / p90 / p99 of vllm:inter_token_latency_seconds: the gap between consecutive tokens of a sequence, "
            "once per token after the first (what a streaming client sees between chunks).",
            quantiles("vllm:inter_token_latency_seconds"),
            "s",
        ),
        w=6,
        h=8,
    )
    g.add(
        timeseries(
            "End-to-end request latency",
            "p50 / p90 / p99 of vllm:e2e_request_latency_seconds (arrival to finish).",
            quantiles("vllm:e2e_request_latency_seconds"),
            "s",
        ),
        w=6,
        h=8,
    )
    g.add(
        timeseries(
            "Queue time",
            "p50 / p90 / p99 of vllm:request_queue_time_seconds (arrival to first "
            "scheduled): the part of TTFT spent waiting.",
            quantiles("vllm:request_queue_time_seconds"),
            "s",
        ),
        w=6,
        h=8,
    )
    g.add(
        timeseries(
            "Prefill and decode time",
            "p50 / p99 per request of vllm:request_prefill_time_seconds (first scheduled to first token) and "
            "vllm:request_decode_time_seconds (first token to finish).",
            targets(
                *[
                    (
                        quantile(q, f"vllm:request_{phase}_time_seconds"),
                        f"{phase} p{round(q * 100)} {{{{model_name}}}}",
                    )
                    for phase in ("prefill", "decode")
                    for q in (0.5, 0.99)
                ]
            ),
            "s",
        ),
        w=12,
        h=8,
    )
    g.add(
        timeseries(
            "Tokens per request",
            "p50 / p99 of vllm:request_prompt_tokens (per request) and vllm:request_generation_tokens (per output "
            "sequence).",
            targets(
                *[
                    (
                        quantile(q, f"vllm:request_{kind}_tokens"),
                        f"{kind} p{round(q * 100)} {{{{model_name}}}}",
                    )
                    for kind in ("prompt", "generation")
                    for q in (0.5, 0.99)
                ]
            ),
            "short",
        ),
        w=12,
        h=8,
    )

    g.row("Memory")
    gauge = {
        "type": "gauge",
        "title": "GPU KV cache usage",
        "description": "vllm:kv_cache_usage_perc: KV blocks held by live requests (evictable prefix-cache blocks "
        "count as free). Yellow from 80%, red from 90% (VLLMHighMemoryUsage > 90%, "
        "VLLMCriticalMemoryUsage > 95%).",
        "datasource": DS,
        "targets": targets((f"vllm:kv_cache_usage_perc{{{M}}} * 100", "{{model_name}} {{instance}}")),
        "fieldConfig": {
            "defaults": {
                "color": {"mode": "thresholds"},
                "unit": "percent",
                "min": 0,
                "max": 100,
                "mappings": [],
                "thresholds": thresholds(("green", None), ("yellow", 80), ("red", 90)),
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "orientation": "auto",
            "showThresholdLabels": False,
            "showThresholdMarkers": True,
            "minVizHeight": 75,
            "minVizWidth": 75,
            "sizing": "auto",
            "shape": "gauge",
            "barShape": "flat",
            "barWidthFactor": 0.5,
            "effects": {},
            "segmentCount": 1,
            "segmentSpacing": 0.3,
            "sparkline": False,
            "textMode": "auto",
        },
    }
    g.add(gauge, w=6, h=8)
    g.add(
        timeseries(
            "KV cache: block usage and token utilization",
            "Block usage (vllm:kv_cache_usage_perc) and the share of token slots in allocated blocks that hold a "
            "token (vllm:kv_cache_token_utilization; the rest is internal fragmentation of last blocks).",
            targets(
                (f"vllm:kv_cache_usage_perc{{{M}}}", "block usage {{model_name}}"),
                (f"vllm:kv_cache_token_utilization{{{M}}}", "token utilization {{model_name}}"),
            ),
            "percentunit",
            max_=1,
        ),
        w=9,
        h=8,
    )
    g.add(
        timeseries(
            "Preemptions",
            "Sequences preempted per second, and per finished request (VLLMHighPreemptionRate above 0.1, "
            "VLLMCriticalPreemptionRate above 1).",
            targets(
                (
                    f"sum by (model_name) (rate(vllm:num_preemptions_total{{{M}}}[{RATE}]))",
                    "preemptions/s {{model_name}}",
                ),
                (
                    f"sum by (model_name) (rate(vllm:num_preemptions_total{{{M}}}[{RATE}])) / "
                    f"sum by (model_name) (rate(vllm:request_success_total{{{M}}}[{RATE}]))",
                    "per finished request {{model_name}}",
                ),
            ),
            "short",
            overrides=[right_axis("B", "short")],
        ),
        w=9,
        h=8,
    )
    g.add(
        timeseries(
            "Allocator efficiency",
            "vllm:gpu_allocator_efficiency = allocated / reserved bytes. Below 0.7 (red line) is the seeds' severe "
            "fragmentation (VLLMHighAllocatorFragmentation); 1 on CPU.",
            targets((f"vllm:gpu_allocator_efficiency{{{M}}}", "{{model_name}} {{instance}}")),
            "percentunit",
            max_=1,
            steps=thresholds(("red", None), ("green", 0.7)),
            threshold_style="line",
        ),
        w=8,
        h=8,
    )
    g.add(
        timeseries(
            "GPU memory: reserved vs allocated",
            "The torch allocator's view: reserved by the caching allocator and allocated to live tensors; the gap "
            "is allocator fragmentation.",
            targets(
                (f"vllm:gpu_memory_reserved_bytes{{{M}}}", "reserved {{model_name}} {{instance}}"),
                (f"vllm:gpu_memory_allocated_bytes{{{M}}}", "allocated {{model_name}} {{instance}}"),
            ),
            "bytes",
        ),
        w=8,
        h=8,
    )
    g.add(
        stat(
            "Fragmentation buffer",
            "vllm:fragmentation_buffer_bytes: memory kept out of the KV budget at start-up for allocator "
            "fragmentation (max(150 MiB, factor x profiled fragmentation)).",
            targets((f"vllm:fragmentation_buffer_bytes{{{M}}}", "{{model_name}} {{instance}}")),
            "bytes",
        ),
        w=8,
        h=8,
    )
    g.add(
        timeseries(
            "Swap",
            "CPU swap blocks in use (vllm:cpu_cache_usage_perc, left) and requests swapped out (right).",
            targets(
                (f"vllm:cpu_cache_usage_perc{{{M}}}", "CPU cache usage {{model_name}}"),
                (f"sum by (model_name) (vllm:num_requests_swapped{{{M}}})", "swapped requests {{model_name}}"),
            ),
            "percentunit",
            max_=1,
            overrides=[right_axis("B", "short")],
        ),
        w=8,
        h=8,
    )
    g.add(
        timeseries(
            "Prefix cache hit rate",
            "Prompt tokens found in the prefix cache / looked up, over the interval, and the engine's own gauge. "
            "Below 0.3 (red line) for 30 minutes with prefix caching on is VLLMPrefixCacheHitRateLow.",
            targets(
                (
                    f"sum by (model_name) (rate(vllm:prefix_cache_hits_total{{{M}}}[{RATE}])) / "
                    f"sum by (model_name) (rate(vllm:prefix_cache_queries_total{{{M}}}[{RATE}]))",
                    "hit rate {{model_name}}",
                ),
                (f"vllm:prefix_cache_hit_rate{{{M}}}", "engine gauge {{model_name}} {{instance}}"),
            ),
            "percentunit",
            max_=1,
            steps=thresholds(("red", None), ("green", 0.3)),
            threshold_style="line",
        ),
        w=8,
        h=8,
    )
    g.add(
        timeseries(
            "Prefix cache blocks",
            "KV blocks holding cached prefixes (vllm:prefix_cache_blocks_used) out of those the prefix cache may "
            "use (vllm:prefix_cache_blocks_total).",
            targets(
                (f"vllm:prefix_cache_blocks_used{{{M}}}", "used {{model_name}} {{instance}}"),
                (f"vllm:prefix_cache_blocks_total{{{M}}}", "total {{model_name}} {{instance}}"),
            ),
            "short",
        ),
        w=8,
        h=8,
    )

    g.row("GPU (NVML, from the supervisor)")
    g.add(
        timeseries(
            "GPU memory",
            "NVML memory used and total per GPU. The engine takes --gpu-memory-utilization (0.9) of it by design; "
            "above 95% is PagekeeperGPUMemoryNearFull.",
            targets(
                (f"pagekeeper_gpu_memory_used_bytes{{{S}}}", "GPU {{gpu}} used ({{instance}})"),
                (f"pagekeeper_gpu_memory_total_bytes{{{S}}}", "GPU {{gpu}} total ({{instance}})"),
            ),
            "bytes",
        ),
        w=6,
        h=8,
    )
    g.add(
        timeseries(
            "GPU utilization",
            "NVML utilization per GPU.",
            targets((f"pagekeeper_gpu_utilization_ratio{{{S}}}", "GPU {{gpu}} ({{instance}})")),
            "percentunit",
            max_=1,
        ),
        w=6,
        h=8,
    )
    g.add(
        timeseries(
            "GPU temperature",
            "NVML temperature per GPU.",
            targets((f"pagekeeper_gpu_temperature_celsius{{{S}}}", "GPU {{gpu}} ({{instance}})")),
            "celsius",
            min_=None,
            steps=thresholds(("green", None), ("orange", 80), ("red", 90)),
            threshold_style="dashed",
        ),
        w=6,
        h=8,
    )
    g.add(
        stat(
            "XID errors",
            "Critical XID events NVML reported since the supervisor started (PagekeeperGPUXidErrors on any increase).",
            targets((f"pagekeeper_gpu_xid_errors_total{{{S}}}", "GPU {{gpu}} ({{instance}})")),
            "short",
            steps=thresholds(("green", None), ("red", 1)),
        ),
        w=6,
        h=8,
    )

    g.row("Supervisor")
    g.add(
        stat(
            "Engine up",
            "pagekeeper_supervisor_engine_up: 1 while the engine answers /health (ok or "
            "draining) at the supervisor's last poll.",
            targets((f"pagekeeper_supervisor_engine_up{{{S}}}", "{{instance}}")),
            "short",
            steps=thresholds(("red", None), ("green", 1)),
            mappings=states(("0", "DOWN", "red"), ("1", "UP", "green")),
        ),
        w=6,
        h=5,
    )
    g.add(
        stat(
            "Crash loop",
            "pagekeeper_supervisor_crash_loop_gave_up: 1 once max_restarts restarts within "
            "restart_window made the supervisor give up (PagekeeperCrashLoopGaveUp); `opsctl restart` resets it.",
            targets((f"pagekeeper_supervisor_crash_loop_gave_up{{{S}}}", "{{instance}}")),
            "short",
            steps=thresholds(("green", None), ("red", 1)),
            mappings=states(("0", "ok", "green"), ("1", "GAVE UP", "red")),
        ),
        w=6,
        h=5,
    )
    g.add(
        stat(
            "Since last restart",
            "Time since the supervisor last restarted the engine "
            "(pagekeeper_supervisor_last_restart_timestamp_seconds).",
            targets((f"time() - (pagekeeper_supervisor_last_restart_timestamp_seconds{{{S}}} > 0)", "{{instance}}")),
            "s",
            no_value="never",
        ),
        w=6,
        h=5,
    )
    g.add(
        stat(
            "Supervisor probes",
            "1 when the supervisor's last read of the engine's /metrics parsed, and when "
            "NVML readings are available (0 on hosts without a GPU).",
            targets(
                (f"pagekeeper_supervisor_engine_metrics_ok{{{S}}}", "engine metrics {{instance}}"),
                (f"pagekeeper_supervisor_nvml_available{{{S}}}", "NVML {{instance}}"),
            ),
            "short",
            steps=thresholds(("orange", None), ("green", 1)),
            mappings=states(("0", "no", "orange"), ("1", "ok", "green")),
        ),
        w=6,
        h=5,
    )
    g.add(
        timeseries(
            "Engine restarts by reason",
            "pagekeeper_supervisor_restarts_total by reason, since the supervisor started (each step up is a "
            "restart; the dashboard's annotations mark them on every graph).",
            targets((f"pagekeeper_supervisor_restarts_total{{{S}}}", "{{reason}} ({{instance}})")),
            "short",
            interpolation="stepAfter",
        ),
        w=12,
        h=8,
    )
    g.add(
        timeseries(
            "Supervisor decisions",
            "pagekeeper_supervisor_decisions_total by action and reason, since the supervisor started (dry-run "
            "decisions included). `opsctl status` shows the last one with its evidence.",
            targets((f"pagekeeper_supervisor_decisions_total{{{S}}}", "{{action}} ({{reason}}) {{instance}}")),
            "short",
            interpolation="stepAfter",
        ),
        w=12,
        h=8,
    )

    restarts = "pagekeeper_supervisor_restarts_total{" + S + "}"
    variable_query = {"qryType": 1, "refId": "PrometheusVariableQueryEditor-VariableQuery"}
    return {
        "id": None,
        "uid": "pagekeeper",
        "title": "pagekeeper",
        "description": "pagekeeper engine (vLLM-compatible metrics) and its supervisor. Alerts: "
        "alerts/pagekeeper-rules.yml; runbook: docs/runbook.md.",
        "tags": ["pagekeeper", "vllm", "llm-inference"],
        "editable": True,
        "graphTooltip": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "weekStart": "",
        "links": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                },
                {
                    "name": "Engine restarts",
                    "datasource": DS,
                    "enable": True,
                    "hide": False,
                    "iconColor": "red",
                    # The supervisor creates every reason's series at 0, so increase() sees a first restart; a
                    # series that is new within the window (a supervisor restarted mid-restart) counts if it is > 0.
                    "target": {
                        "datasource": DS,
                        "refId": "Anno",
                        "interval": "30s",
                        "expr": f"sum by (instance, reason) (increase({restarts}[1m]) > 0 or "
                        f"({restarts} unless {restarts} offset 1m) > 0)",
                    },
                    "titleFormat": "Engine restarted",
                    "textFormat": "reason: {{reason}} (supervisor {{instance}})",
                    "tagKeys": "reason",
                    "useValueForTime": False,
                },
            ]
        },
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "refresh": 1,
                    "regex": "",
                    "hide": 0,
                    "includeAll": False,
                    "multi": False,
                },
                {
                    "name": "model_name",
                    "label": "Model",
                    "type": "query",
                    "datasource": DS,
                    "query": {**variable_query, "query": "label_values(vllm:num_requests_running, model_name)"},
                    "refresh": 2,
                    "regex": "",
                    "sort": 1,
                    "hide": 0,
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                },
                {
                    "name": "supervisor",
                    "label": "Supervisor",
                    "type": "query",
                    "datasource": DS,
                    "query": {**variable_query, "query": "label_values(pagekeeper_supervisor_engine_up, instance)"},
                    "refresh": 2,
                    "regex": "",
                    "sort": 1,
                    "hide": 0,
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                },
            ]
        },
        "panels": g.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python3 grafana/build_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
