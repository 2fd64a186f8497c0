"""Must-show 2: grafana/pagekeeper.json type-checks against Grafana's own schema (@grafana/schema with
TypeScript, `tsc --noEmit --strict`), the check catches planted mistakes, and the dashboard has the issue's layout.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from tests.alerts.tools import (
    DASHBOARD,
    REPO,
    TYPECHECK,
    in_ci,
    load_dashboard,
    panel_targets,
    selectors,
    tsc_path,
    typecheck,
)


def need_typechecker() -> None:
    if tsc_path().exists() and (TYPECHECK / "node_modules" / "@grafana" / "schema").is_dir():
        return
    message = f"{TYPECHECK}/node_modules is missing (scripts/setup.sh --test runs npm ci there)"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def test_json_is_what_the_build_script_writes():
    r = subprocess.run(
        [sys.executable, str(REPO / "grafana" / "build_dashboard.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr


def test_dashboard_typechecks_against_grafana_schema():
    need_typechecker()
    r = typecheck(DASHBOARD.read_text())
    assert r.returncode == 0, r.stdout + r.stderr


PLANTED = {
    # one mistake per kind: an enum spelled wrong, a misspelled plugin option, a wrong type, a missing field
    "threshold mode": (lambda d: gauge(d)["fieldConfig"]["defaults"]["thresholds"].update(mode="absolut"), '"absolut"'),
    "timeseries option": (lambda d: first(d, "timeseries")["options"].update(legned={}), "legned"),
    "threshold value": (
        lambda d: gauge(d)["fieldConfig"]["defaults"]["thresholds"]["steps"][1].update(value="80"),
        "not assignable to type 'number",
    ),
    "target refId": (lambda d: first(d, "timeseries")["targets"][0].pop("refId"), "refId"),
}


def first(d: dict, kind: str) -> dict:
    return next(p for p in d["panels"] if p["type"] == kind)


def gauge(d: dict) -> dict:
    return first(d, "gauge")


@pytest.mark.parametrize("name", PLANTED)
def test_typecheck_catches_a_planted_error(name):
    need_typechecker()
    mutate, expected = PLANTED[name]
    d = copy.deepcopy(load_dashboard())
    mutate(d)
    r = typecheck(json.dumps(d, indent=2))
    assert r.returncode != 0, f"planted error not caught: {name}"
    assert "error TS" in r.stdout and expected in r.stdout, r.stdout


def test_variables_rows_and_the_seed_gauge():
    d = load_dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["query"]["query"] == "label_values(vllm:num_requests_running, model_name)"
    assert variables["model_name"]["multi"] and variables["model_name"]["includeAll"]

    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["Overview", "Latency", "Memory", "GPU (NVML, from the supervisor)", "Supervisor"]

    # the seed's GPU cache usage gauge, its thresholds inside fieldConfig where Grafana reads them
    g = gauge(d)
    assert g["targets"][0]["expr"] == 'vllm:kv_cache_usage_perc{model_name=~"$model_name"} * 100'
    steps = g["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [(s["color"], s["value"]) for s in steps] == [("green", None), ("yellow", 80), ("red", 90)]

    exprs = " ".join(t["expr"] for _, t in panel_targets(d))
    for needle in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:request_failure_total",
        "histogram_quantile(0.99, sum by (model_name, le) (rate(vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:request_prefill_time_seconds_bucket",
        "vllm:request_decode_time_seconds_bucket",
        "vllm:request_generation_tokens_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:kv_cache_token_utilization",
        "vllm:gpu_allocator_efficiency",
        "vllm:gpu_memory_reserved_bytes",
        "vllm:gpu_memory_allocated_bytes",
        "vllm:fragmentation_buffer_bytes",
        "vllm:cpu_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total",
        "pagekeeper_gpu_memory_used_bytes",
        "pagekeeper_gpu_utilization_ratio",
        "pagekeeper_gpu_temperature_celsius",
        "pagekeeper_supervisor_restarts_total",
        "pagekeeper_supervisor_decisions_total",
        "pagekeeper_supervisor_crash_loop_gave_up",
    ):
        assert needle in exprs, needle
    annotations = [a for a in d["annotations"]["list"] if "target" in a]
    assert [a["name"] for a in annotations] == ["Engine restarts"]
    assert "pagekeeper_supervisor_restarts_total" in annotations[0]["target"]["expr"]


def test_every_query_filters_by_its_variable_and_uses_the_datasource_variable():
    d = load_dashboard()
    for panel, t in panel_targets(d):
        assert panel["datasource"] == t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for sel in selectors(t["expr"]):
            if sel.startswith("vllm:"):
                assert 'model_name=~"$model_name"' in sel, (panel["title"], sel)
            else:
                assert sel.startswith("pagekeeper_") and 'instance=~"$supervisor"' in sel, (panel["title"], sel)


def test_panel_ids_are_unique_and_panels_do_not_overlap():
    d = load_dashboard()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]
