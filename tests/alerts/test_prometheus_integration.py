"""Must-show 3: a real Prometheus (the Debian package's binary) scrapes the real engine (embedded model) and the real
supervisor every second, with the alert rules loaded (their `for:` shortened to 2 s). Traffic through a tiny engine
(--max-num-seqs 1) makes VLLMQueueBacklog fire for real, seen on /api/v1/alerts. Then every dashboard query and
every alert expression goes through Prometheus' HTTP API: every query parses, every series the dashboard plots
exists, and every metric selector of every alert returns series.  The engine runs with `--metrics-names vllm`
(vLLM's names only), so the same queries prove that nothing of ours needs the seed's underscore forms, and the
names that vLLM's own example dashboard and production-stack's KEDA trigger query return series too.

One deployment serves all the tests of this module (about a minute on 2 cores); every process is killed by PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.alerts.tools import (
    alert_rules,
    annotation_targets,
    fast_rules_text,
    load_dashboard,
    panel_targets,
    require_tool,
    selectors,
    substitute,
)
from tests.opsctl.harness import Deployment, deployment
from tests.server.harness import free_port

pytestmark = pytest.mark.slow

MODEL = "pagekeeper-default"
# Shares a prefix of more than two 16-token blocks, so the prefix cache has something to hit.
PROMPT = (
    "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex. "
    "Complex is better than complicated. Flat is better than nested."
)
IN_FLIGHT = 8  # with --max-num-seqs 1: 1 running, 7 waiting > 3 x 1
# Every metric name vLLM's example Grafana dashboard queries (vllm-project/vllm,
# examples/observability/prometheus_grafana/grafana.json): histograms by their _bucket/_sum/_count series.
VLLM_DASHBOARD_HISTOGRAMS = [
    "vllm:e2e_request_latency_seconds",  # p50-p99 and mean
    "vllm:inter_token_latency_seconds",  # p50-p99 and mean
    "vllm:time_to_first_token_seconds",  # p50-p99 and mean
    "vllm:request_prompt_tokens",  # heatmap
    "vllm:request_generation_tokens",  # heatmap
    "vllm:request_queue_time_seconds",  # rate of _sum
    "vllm:request_prefill_time_seconds",  # rate of _sum
    "vllm:request_decode_time_seconds",  # rate of _sum
    "vllm:request_max_num_generation_tokens",  # rate of _sum
]
VLLM_DASHBOARD_SERIES = [
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:request_success_total",
    # earlier versions of that dashboard (vLLM <= 0.10) and production-stack's dashboards
    "vllm:gpu_cache_usage_perc",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:num_requests_swapped",
]
# production-stack's KEDA ScaledObject (tutorials/assets/values-20-keda.yaml): a Prometheus trigger on this query
KEDA_QUERY = "vllm:num_requests_waiting"

FAKE_GPUS = [
    {
        "index": 0,
        "name": "Fake H100",
        "memory_used_bytes": 60 * 2**30,
        "memory_total_bytes": 80 * 2**30,
        "utilization_ratio": 0.9,
        "temperature_celsius": 71.0,
        "xid_errors_total": 2,
    }
]


@dataclass
class Prometheus:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def get(self, path: str, **params: Any) -> Any:
        r = httpx.get(self.url + path, params=params, timeout=10)
        body = r.json()
        assert body.get("status") == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> dict[str, Any]:
        """Instant query; the raw reply (status error included)."""
        return httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10).json()

    def query_range(self, expr: str, start: float, end: float, step: str) -> dict[str, Any]:
        return httpx.get(
            self.url + "/api/v1/query_range",
            params={"query": expr, "start": start, "end": end, "step": step},
            timeout=10,
        ).json()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_prometheus(root: Path, engine_port: int, supervisor_port: int) -> Prometheus:
    binary = require_tool("prometheus", "Debian package prometheus")
    root.mkdir(parents=True, exist_ok=True)
    (root / "rules.yml").write_text(fast_rules_text("2s"))
    (root / "prometheus.yml").write_text(
        json.dumps(
            {  # JSON is YAML
                "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                "rule_files": ["rules.yml"],
                "scrape_configs": [
                    {"job_name": "pagekeeper-engine", "static_configs": [{"targets": [f"127.0.0.1:{engine_port}"]}]},
                    {
                        "job_name": "pagekeeper-supervisor",
                        "static_configs": [{"targets": [f"127.0.0.1:{supervisor_port}"]}],
                    },
                ],
            },
            indent=2,
        )
    )
    port = free_port()
    log_path = root / "prometheus.log"
    cmd = [
        binary,
        f"--config.file={root / 'prometheus.yml'}",
        f"--storage.tsdb.path={root / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--web.enable-lifecycle",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    prom = Prometheus(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}:\n{prom.log()[-3000:]}")
        try:
            if httpx.get(prom.url + "/-/ready", timeout=1).status_code == 200:
                return prom
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"prometheus not ready:\n{prom.log()[-3000:]}")


@dataclass
class Stack:
    prom: Prometheus
    d: Deployment
    supervisor_instance: str
    started: float  # wall clock before the first scrape
    traffic_started: float = 0.0  # after the engine restarted from kill -9
    backlog_alert: dict[str, Any] | None = None
    alert_states: dict[str, set[str]] = field(default_factory=dict)  # alertname -> states seen
    results: list[Any] = field(default_factory=list)

    @property
    def engine_instance(self) -> str:
        return f"127.0.0.1:{self.d.port}"

    def window(self) -> str:
        """A PromQL range that covers the whole test, for `..._over_time(...)`."""
        return f"{int(time.time() - self.started) + 5}s"

    def exists(self, selector: str) -> bool:
        """The selector had series at some point of the test (a scrape that failed just now makes the latest
        samples stale, which an instant query would take for absence)."""
        return bool(self.prom.query(f"last_over_time({selector}[{self.window()}])")["data"]["result"])

    def diagnostics(self) -> str:
        try:
            restarts = self.d.status()["restarts"]
        except Exception as e:  # noqa: BLE001 - diagnostics only
            restarts = repr(e)
        targets = [
            (t["labels"]["job"], t["health"], t.get("lastError"))
            for t in self.prom.get("/api/v1/targets")["activeTargets"]
        ]
        return f"restarts: {restarts}; targets now: {targets}"


def drive_traffic_until_backlog_fires(stack: Stack, deadline_s: float = 120) -> None:
    """Keep IN_FLIGHT requests in flight until Prometheus reports VLLMQueueBacklog firing, then let them finish."""

    async def run() -> None:
        stop = asyncio.Event()

        async def one(client: httpx.AsyncClient, i: int) -> None:
            body = {
                "model": MODEL,
                "prompt": PROMPT if i % 4 else f"{PROMPT} Sparse is better than dense.",
                "max_tokens": 48,
                "ignore_eos": True,
                "temperature": 0,
            }
            r = await client.post("/v1/completions", json=body)
            stack.results.append(r.status_code)

        async def worker(client: httpx.AsyncClient, k: int) -> None:
            i = k
            while not stop.is_set():
                await one(client, i)
                i += IN_FLIGHT

        async def watch(client: httpx.AsyncClient) -> None:
            end = time.monotonic() + deadline_s
            while time.monotonic() < end:
                alerts = (await client.get(stack.prom.url + "/api/v1/alerts")).json()["data"]["alerts"]
                for a in alerts:
                    stack.alert_states.setdefault(a["labels"]["alertname"], set()).add(a["state"])
                    if a["labels"]["alertname"] == "VLLMQueueBacklog" and a["state"] == "firing":
                        stack.backlog_alert = a
                if stack.backlog_alert:
                    break
                await asyncio.sleep(0.25)
            stop.set()

        async with httpx.AsyncClient(base_url=stack.d.url, timeout=120) as client:
            workers = [asyncio.create_task(worker(client, k)) for k in range(IN_FLIGHT)]
            await watch(client)
            await asyncio.gather(*workers)
            # an invalid request, so that the failure series moves too
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 10**6})
            stack.results.append(r.status_code)

    asyncio.run(run())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    require_tool("prometheus", "Debian package prometheus")
    root = tmp_path_factory.mktemp("prometheus-stack")
    gpus = root / "gpus.json"
    gpus.write_text(json.dumps(FAKE_GPUS))
    supervisor_port = free_port()
    d = deployment(
        root / "deploy",
        # vLLM's names only: the rules, the dashboard and the supervisor must need nothing else
        engine={"max_num_seqs": 1, "max_waiting": 100, "enable_prefix_caching": True, "metrics_names": "vllm"},
        # policy rules that would restart this deliberately backed-up engine are switched off
        supervisor={
            "metrics_port": supervisor_port,
            "poll_interval": 0.5,
            "probe_timeout": 2.0,
            "hang_seconds": 60.0,
            "backlog_factor": 1000.0,
            "cache_usage_threshold": 1.0,
        },
    )
    d.root.mkdir(parents=True, exist_ok=True)
    started = time.time()
    prom = start_prometheus(root / "prometheus", d.port, supervisor_port)
    s = Stack(prom, d, f"127.0.0.1:{supervisor_port}", started)
    try:
        r = d.opsctl("start", env={"PAGEKEEPER_FAKE_NVML": str(gpus)})
        assert r.returncode == 0, r.stdout + r.stderr + d.log("supervisor.log")[-3000:]
        assert d.status()["supervisor"]["metrics_url"] == f"http://{s.supervisor_instance}/metrics"
        # one real supervisor decision: kill -9 the engine, the supervisor restarts it
        old = d.engine_pid()
        os.kill(old, signal.SIGKILL)
        d.wait_for(
            lambda st: st["engine"]["state"] == "serving" and st["engine"]["pid"] not in (None, old),
            90,
            "the engine restarted after kill -9",
        )
        s.traffic_started = time.time()
        drive_traffic_until_backlog_fires(s)
        time.sleep(2.5)  # the last scrapes
        yield s
    finally:
        prom.proc.kill()  # by PID
        prom.proc.wait(10)
        d.teardown()


def test_prometheus_scrapes_both_targets(stack: Stack):
    targets = stack.prom.get("/api/v1/targets")["activeTargets"]
    assert {(t["labels"]["job"], t["labels"]["instance"]) for t in targets} == {
        ("pagekeeper-engine", stack.engine_instance),
        ("pagekeeper-supervisor", stack.supervisor_instance),
    }, targets
    # since the engine came back from kill -9, most 1 s scrapes succeeded (a loaded 2-core machine may miss one)
    since = f"{int(time.time() - stack.traffic_started)}s"
    share = {
        s["metric"]["job"]: float(s["value"][1])
        for s in stack.prom.query(f"avg_over_time(up[{since}])")["data"]["result"]
    }
    print(f"share of successful scrapes: {share}")
    assert share.keys() == {"pagekeeper-engine", "pagekeeper-supervisor"}
    assert min(share.values()) > 0.5, (share, stack.diagnostics())


def test_queue_backlog_alert_fires_for_real(stack: Stack):
    a = stack.backlog_alert
    assert a is not None, (
        f"VLLMQueueBacklog never fired; states seen: {stack.alert_states}; "
        f"responses: {stack.results[-20:]}\n{stack.prom.log()[-2000:]}"
    )
    assert a["labels"] == {
        "alertname": "VLLMQueueBacklog",
        "severity": "warning",
        "job": "pagekeeper-engine",
        "instance": stack.engine_instance,
        "model_name": MODEL,
    }
    assert a["annotations"]["summary"] == f"{MODEL} on {stack.engine_instance}: the request queue is backing up"
    waiting = int(re.match(r"(\d+) requests are waiting", a["annotations"]["description"]).group(1))
    assert waiting > 3  # more than 3 x 1 running
    assert a["annotations"]["runbook_url"] == "docs/runbook.md#vllmqueuebacklog"
    assert all(code == 200 for code in stack.results[:-1]), stack.results
    assert stack.results[-1] == 400
    # with requests in flight the step loop advanced at every scrape (VLLMEngineHung's `for:` was 2 s too).
    # (VLLMEngineStepLoopStopped may go pending for a second right after the restart: the first scrapes of a new
    # engine, queued on the supervisor's socket while it loaded, can read the counter before the loop ran once.
    # With the real `for:` and window that needs 4 minutes of no progress.)
    assert "VLLMEngineHung" not in stack.alert_states
    print(f"alert states seen: { {k: sorted(v) for k, v in stack.alert_states.items()} }")


def dashboard_variables(stack: Stack) -> dict[str, str]:
    return {"datasource": "prometheus", "model_name": MODEL, "supervisor": stack.supervisor_instance}


def test_dashboard_variables_find_the_model_and_the_supervisor(stack: Stack):
    wanted = {"model_name": MODEL, "supervisor": stack.supervisor_instance}
    for v in load_dashboard()["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\(([\w:]+), (\w+)\)", v["query"]["query"])
        assert m, v["query"]
        values = stack.prom.get(f"/api/v1/label/{m.group(2)}/values", **{"match[]": m.group(1)})
        assert wanted[v["name"]] in values, (v["name"], values)


def test_every_dashboard_query_parses_and_every_plotted_series_exists(stack: Stack):
    variables = dashboard_variables(stack)
    end = time.time()
    problems = []
    checked = 0
    for panel, t in panel_targets(load_dashboard()):
        expr = substitute(t["expr"], variables)
        reply = stack.prom.query_range(expr, stack.started, end, "1s")
        where = f"panel {panel['title']!r} {t['refId']}: {expr}"
        if reply["status"] != "success":
            problems.append(f"{where}: {reply.get('error')}")
            continue
        if not reply["data"]["result"]:
            problems.append(f"{where}: no series")
        for sel in selectors(expr):
            if not stack.exists(sel):
                problems.append(f"{where}: selector {sel} has no series")
        checked += 1
    assert not problems, "\n".join(problems) + "\n" + stack.diagnostics()
    assert checked >= 40, checked


def test_restart_annotation_finds_the_kill_9_restart(stack: Stack):
    variables = dashboard_variables(stack)
    for annotation, raw in annotation_targets(load_dashboard()):
        expr = substitute(raw, variables)
        reply = stack.prom.query_range(expr, stack.started, time.time(), "1s")
        assert reply["status"] == "success", (annotation["name"], reply)
        series = reply["data"]["result"]
        assert [s["metric"] for s in series] == [{"instance": stack.supervisor_instance, "reason": "engine_exited"}], (
            annotation["name"],
            series,
            stack.diagnostics(),
        )


def test_every_alert_expression_parses_evaluates_and_reads_existing_series(stack: Stack):
    groups = stack.prom.get("/api/v1/rules")["groups"]
    rules = [r for g in groups for r in g["rules"] if r["type"] == "alerting"]
    assert sorted(r["name"] for r in rules) == sorted(r["alert"] for r in alert_rules())
    problems = []
    for r in rules:
        if r["health"] != "ok":
            problems.append(f"{r['name']}: health {r['health']} {r.get('lastError')}")
        reply = stack.prom.query(r["query"])
        if reply["status"] != "success":
            problems.append(f"{r['name']}: {reply.get('error')}")
        for sel in selectors(r["query"]):
            if not stack.exists(sel):
                problems.append(f"{r['name']}: selector {sel} has no series")
    assert not problems, "\n".join(problems) + "\n" + stack.diagnostics()


def test_vllm_dashboard_and_keda_trigger_names_return_series(stack: Stack):
    window = stack.window()
    model = f'model_name="{MODEL}"'
    problems = []
    checked = 0
    for name in VLLM_DASHBOARD_HISTOGRAMS:
        for suffix in ("_bucket", "_sum", "_count"):
            if not stack.exists(f"{name}{suffix}{{{model}}}"):
                problems.append(f"{name}{suffix}: no series")
        # the dashboard's shapes: a quantile of the bucket rates, and the mean as rate(_sum) / rate(_count)
        for expr in (
            f"histogram_quantile(0.99, sum by (le) (rate({name}_bucket{{{model}}}[{window}])))",
            f"rate({name}_sum{{{model}}}[{window}]) / rate({name}_count{{{model}}}[{window}])",
        ):
            result = stack.prom.query(expr)["data"]["result"]
            value = float(result[0]["value"][1]) if result else float("nan")
            if not value > 0:  # NaN (nothing observed) or 0 would be an empty panel
                problems.append(f"{expr} = {value}")
            checked += 1
    for name in VLLM_DASHBOARD_SERIES:
        if not stack.exists(f"{name}{{{model}}}"):
            problems.append(f"{name}: no series")
        checked += 1
    assert not problems, "\n".join(problems) + "\n" + stack.diagnostics()
    # the engine was asked for vLLM's names only, and the supervisor reads them
    assert not stack.exists("vllm_num_requests_waiting") and not stack.exists("vllm_engine_steps_total")
    engine = stack.d.fast_status()["engine"]
    assert engine["metrics_error"] is None and engine["steps_total"] and engine["kv_cache_usage"] is not None, engine

    deadline = time.monotonic() + 10  # a scrape that failed just now leaves no current sample for a moment
    while not (keda := stack.prom.query(KEDA_QUERY)["data"]["result"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [(s["metric"]["job"], s["metric"]["instance"], s["metric"]["model_name"]) for s in keda] == [
        ("pagekeeper-engine", stack.engine_instance, MODEL)
    ], keda
    print(f"{checked} vLLM dashboard queries return data; KEDA's {KEDA_QUERY} = {keda[0]['value'][1]}")
