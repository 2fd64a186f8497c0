"""Must-show 1: the alert rules pass `promtool check rules` and their unit tests (`promtool test rules`), every alert
has a firing case and a near miss, a runbook section, and reads only metrics that pagekeeper exports.
"""

from __future__ import annotations

import re
import subprocess
from types import SimpleNamespace

import pytest
import yaml

from tests.alerts.tools import (
    ALERTS,
    RULE_TESTS,
    RULES,
    RUNBOOK,
    alert_rules,
    github_anchor,
    require_tool,
    runbook_anchors,
    selectors,
)

SEVERITIES = {"warning", "critical"}


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ALERTS.parent)


def test_promtool_check_rules():
    promtool = require_tool("promtool", "Debian package prometheus")
    r = run([promtool, "check", "rules", str(RULES)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in r.stdout, r.stdout


def test_promtool_unit_tests_pass():
    promtool = require_tool("promtool", "Debian package prometheus")
    assert RULE_TESTS, "no alerts/tests/*.yml"
    r = run([promtool, "test", "rules", *map(str, RULE_TESTS)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == len(RULE_TESTS), r.stdout


def test_example_prometheus_config_is_valid():
    promtool = require_tool("promtool", "Debian package prometheus")
    r = run([promtool, "check", "config", str(ALERTS / "prometheus.yml")])
    assert r.returncode == 0, r.stdout + r.stderr
    config = yaml.safe_load((ALERTS / "prometheus.yml").read_text())
    jobs = {c["job_name"] for c in config["scrape_configs"]}
    # the rules select up{job=...} by these names
    assert {"pagekeeper-engine", "pagekeeper-supervisor"} <= jobs
    assert "pagekeeper-rules.yml" in config["rule_files"]


def test_example_alertmanager_config_routes_by_severity_and_inhibits_twins():
    config = yaml.safe_load((ALERTS / "alertmanager.yml").read_text())
    receivers = {r["name"] for r in config["receivers"]}
    routes = config["route"]["routes"]
    assert config["route"]["receiver"] in receivers and all(r["receiver"] in receivers for r in routes)
    assert {m for r in routes for m in r["matchers"]} == {f'severity="{s}"' for s in SEVERITIES}
    names = {r["alert"] for r in alert_rules()}
    for rule in config["inhibit_rules"]:
        for m in rule["source_matchers"] + rule["target_matchers"]:
            for name in re.findall(r"\w+", m.split("=", 1)[1]):
                assert name in names, f"inhibit rule names unknown alert {name}"
    amtool = require_tool("amtool", "Debian package prometheus-alertmanager")
    r = run([amtool, "check-config", str(ALERTS / "alertmanager.yml")])
    assert r.returncode == 0, r.stdout + r.stderr
    for severity, receiver in (("critical", "oncall-pager"), ("warning", "team-chat")):
        r = run(
            [
                amtool,
                "config",
                "routes",
                "test",
                "--config.file",
                str(ALERTS / "alertmanager.yml"),
                "alertname=VLLMQueueBacklog",
                f"severity={severity}",
            ]
        )
        assert r.returncode == 0 and r.stdout.strip() == receiver, (severity, r.stdout, r.stderr)


def test_every_alert_has_the_house_style():
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), "duplicate alert names"
    # the seed's four keep their names and thresholds, read by vLLM's metric names
    by_name = {r["alert"]: r for r in rules}
    assert re.sub(r"\s+", " ", by_name["VLLMHighMemoryUsage"]["expr"]).strip() == "vllm:kv_cache_usage_perc > 0.90"
    assert by_name["VLLMHighMemoryUsage"]["for"] == "5m"
    assert re.sub(r"\s+", " ", by_name["VLLMCriticalMemoryUsage"]["expr"]).strip() == "vllm:kv_cache_usage_perc > 0.95"
    assert by_name["VLLMCriticalMemoryUsage"]["for"] == "2m"
    assert "vllm:num_requests_waiting > vllm:num_requests_running * 3" in by_name["VLLMQueueBacklog"]["expr"]
    assert by_name["VLLMQueueBacklog"]["for"] == "5m"
    assert "VLLMNoRequests" in by_name
    for r in rules:
        name = r["alert"]
        assert re.fullmatch(r"(VLLM|Pagekeeper)[A-Z][A-Za-z0-9]+", name), name
        assert "for" in r, name
        assert r["labels"]["severity"] in SEVERITIES, name
        ann = r["annotations"]
        assert set(ann) == {"summary", "description", "runbook_url"}, name
        assert "{{ $labels." in ann["summary"] + ann["description"], name
        assert ann["runbook_url"] == f"docs/runbook.md#{github_anchor(name)}", name


def test_every_alert_has_a_runbook_section_that_says_what_to_do():
    anchors = runbook_anchors()
    text = RUNBOOK.read_text()
    sections = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    for r in alert_rules():
        name = r["alert"]
        assert r["annotations"]["runbook_url"].split("#", 1)[1] in anchors, name
        body = sections.get(name, "")
        for part in ("**Means.**", "**Confirm.**", "**Act.**"):
            assert part in body, f"runbook section {name} lacks {part}"
    # internal links point at existing sections
    for target in re.findall(r"\]\(#([\w-]+)\)", text):
        assert target in anchors, target


def _unit_tests() -> list[dict]:
    return [t for f in RULE_TESTS for t in yaml.safe_load(f.read_text())["tests"]]


def test_every_alert_has_a_unit_test_that_fires_and_one_that_must_not():
    fires: dict[str, int] = {}
    quiet: dict[str, int] = {}
    for test in _unit_tests():
        for case in test.get("alert_rule_test", []):
            name, expected = case["alertname"], case.get("exp_alerts") or []
            (fires if expected else quiet)[name] = (fires if expected else quiet).get(name, 0) + 1
            for alert in expected:  # a firing case checks the rendered annotations too
                assert set(alert.get("exp_annotations", {})) == {"summary", "description", "runbook_url"}, (
                    test["name"],
                    name,
                )
                assert "{{" not in str(alert["exp_annotations"]), (test["name"], name)
    names = [r["alert"] for r in alert_rules()]
    assert [n for n in names if n not in fires] == [], "alerts without a firing unit test"
    assert [n for n in names if n not in quiet] == [], "alerts without a near-miss unit test"
    assert set(fires) | set(quiet) <= set(names), "unit tests name an alert that does not exist"


def _exported_metric_names() -> set[str]:
    """Every sample name the engine (with --metrics-names vllm, vLLM's names only: the rules must not need the
    seed's) and the supervisor export, from their own metric definitions."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from engine.server.metrics import EngineMetrics
    from opsctl.exporter import SupervisorMetrics
    from opsctl.probes import GpuReading

    engine = EngineMetrics("m", {"enable_prefix_caching": "True", "block_size": "16"}, 0, names="vllm")
    engine_text = engine.render().decode()
    fake = SimpleNamespace(last_gpu=[GpuReading(0, "GPU", 1, 2, 0.5, 40.0, 0)])
    supervisor = SupervisorMetrics(fake)  # type: ignore[arg-type]
    supervisor.restarts.labels("hang").inc()
    supervisor.decisions.labels("restart", "hang").inc()
    text = engine_text + generate_latest(supervisor.registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples} | {"up"}


def test_selector_extraction():
    expr = (
        'sum by (job, instance) (sum by (job, instance, reason) (x_total{reason!="manual"} unless '
        'x_total{reason!="manual"} offset 1h) or sum by (job, instance, reason) '
        '(increase(x_total{reason!="manual"}[1h]))) >= 3 and on (job) up{job="a"} == 0 '
        'and histogram_quantile(0.99, rate(h_bucket{le!="+Inf", a=~"$x"}[5m])) > bool 2'
    )
    assert selectors(expr) == ['x_total{reason!="manual"}', 'up{job="a"}', 'h_bucket{le!="+Inf", a=~"$x"}']
    assert selectors("time() - (g > 0)") == ["g"]
    assert selectors('vllm:cache_config_info{enable_prefix_caching="True"} == 1') == [
        'vllm:cache_config_info{enable_prefix_caching="True"}'
    ]


def test_rules_read_only_exported_metrics():
    exported = _exported_metric_names()
    for r in alert_rules():
        for sel in selectors(r["expr"]):
            name = sel.split("{", 1)[0]
            assert name in exported, f"{r['alert']} reads {name}, which nothing exports"


@pytest.mark.parametrize("path", RULE_TESTS, ids=lambda p: p.name)
def test_unit_test_series_use_exported_metric_names(path):
    exported = _exported_metric_names()
    for test in yaml.safe_load(path.read_text())["tests"]:
        for s in test["input_series"]:
            name = s["series"].split("{", 1)[0]
            assert name in exported, f"{test['name']}: {name} is not an exported metric"
