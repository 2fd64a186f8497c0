"""The Helm chart renders manifests that a current Kubernetes accepts, built from the repository's own sources.

- every object validates against the Kubernetes 1.37 API schemas (kubernetes-validate, strict: an unknown field
  is an error), the custom resources against prometheus-operator's and KEDA's schemas (@kubernetes-models, npm);
- the PrometheusRule's groups are alerts/pagekeeper-rules.yml and pass `promtool check rules`; the dashboard
  ConfigMap holds grafana/pagekeeper.json byte for byte;
- the rendered config file passes the strict config schema that opsctl and the engine share;
- the values that must agree do (grace period > preStop delay + drain, startup probe >= cold start), and the
  chart refuses the combinations that would not work, and values of the wrong type or name (values.schema.json).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from opsctl.config import load_config
from tests.alerts.tools import DASHBOARD, RULES, require_tool
from tests.k8s.chart import by_kind, lint, render
from tests.k8s.crd_tools import validate_custom_resources

KUBERNETES_VERSION = "1.37.0"
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject"}

# The value sets the tests render: the defaults, a GPU fleet with tensor parallelism and KEDA, and one with an API
# key Secret, a model volume, extra config keys and an HPA.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "gpu-tp2-keda": {
        "gpu": {"enabled": True},
        "engine": {"tensorParallelSize": 2, "model": "/models/Qwen2-7B-Instruct", "extra": {"max_model_len": 8192}},
        "image": {"digest": "sha256:" + "0" * 64},
        "autoscaling": {"keda": {"enabled": True}},
        "probes": {"coldStartSeconds": 300},
    },
    "secret-volume-hpa": {
        "secrets": {"existingSecret": "pagekeeper-keys"},
        "modelVolume": {
            "enabled": True,
            "source": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        },
        "engine": {"extra": {"gpu_memory_utilization": 0.85, "served_model_name": "qwen", "max_num_seqs": 128}},
        "supervisor": {"extra": {"hang_seconds": 90, "max_restarts": 5}, "drainTimeoutSeconds": 120},
        "autoscaling": {"hpa": {"enabled": True}},
        "networkPolicy": {"apiFrom": [{"podSelector": {"matchLabels": {"role": "gateway"}}}]},
    },
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(values) for name, values in VALUE_SETS.items()}


def test_chart_lints_clean() -> None:
    report = lint()
    problems = [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report["errors"]]
    print(f"helm lint --strict: {len(report['messages'])} message(s), {len(problems)} warning(s) or error(s)")
    assert not problems, problems


def test_manifests_validate_against_kubernetes_schemas(rendered: dict[str, list[dict[str, Any]]]) -> None:
    import kubernetes_validate

    checked = 0
    for name, objects in rendered.items():
        for obj in objects:
            if obj["kind"] in CUSTOM_KINDS:
                continue
            try:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {obj['kind']} {obj['metadata']['name']}: {e.message} at {list(e.path)}")
            checked += 1
    kinds = sorted({o["kind"] for objects in rendered.values() for o in objects if o["kind"] not in CUSTOM_KINDS})
    print(f"kubernetes {KUBERNETES_VERSION} schemas: {checked} objects valid ({', '.join(kinds)})")
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= set(kinds)


def test_custom_resources_validate_against_their_crd_schemas(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = [o for objects in rendered.values() for o in objects if o["kind"] in CUSTOM_KINDS]
    results = validate_custom_resources(objects)
    invalid = [r for r in results if not r.get("valid")]
    print(f"custom resources: {len(results) - len(invalid)} of {len(results)} valid")
    assert not invalid, invalid
    assert {r["kind"].rsplit("/", 1)[1] for r in results} == CUSTOM_KINDS


def test_prometheus_rule_is_the_alert_rules_file(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    rule = by_kind(rendered["defaults"], "PrometheusRule")
    source = yaml.safe_load(RULES.read_text())
    assert rule["spec"] == {"groups": source["groups"]}
    promtool = require_tool("promtool", "Debian package prometheus")
    extracted = tmp_path / "from-chart.yml"
    extracted.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    r = subprocess.run([promtool, "check", "rules", str(extracted)], capture_output=True, text=True, timeout=60)
    print(r.stdout.strip())
    assert r.returncode == 0, r.stdout + r.stderr
    alerts = sum(len(g["rules"]) for g in rule["spec"]["groups"])
    print(f"PrometheusRule: {len(rule['spec']['groups'])} groups, {alerts} rules, equal to {RULES.name}")


def test_dashboard_configmap_is_the_dashboard_file(rendered: dict[str, list[dict[str, Any]]]) -> None:
    dashboards = [
        o for o in rendered["defaults"] if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")
    ]
    (cm,) = dashboards
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label
    assert cm["data"] == {"pagekeeper.json": DASHBOARD.read_text()}
    json.loads(cm["data"]["pagekeeper.json"])
    print(f"dashboard ConfigMap: {len(cm['data']['pagekeeper.json'])} characters, equal to {DASHBOARD.name}")


@pytest.mark.parametrize("values_name", list(VALUE_SETS))
def test_config_file_passes_the_config_schema(
    rendered: dict[str, list[dict[str, Any]]], values_name: str, tmp_path: Path
) -> None:
    (cm,) = [o for o in rendered[values_name] if o["metadata"]["name"].endswith("-config")]
    path = tmp_path / "pagekeeper.toml"
    path.write_text(cm["data"]["pagekeeper.toml"])
    cfg = load_config(path)  # strict: a float where an int belongs, or an unknown key, is an error
    values = VALUE_SETS[values_name]
    assert cfg.engine["host"] == "0.0.0.0" and cfg.supervisor.launcher == "process"
    assert cfg.supervisor.log_to_stdout and cfg.supervisor.metrics_host == "0.0.0.0"
    for key, value in values.get("engine", {}).get("extra", {}).items():
        assert cfg.engine[key] == value
    assert cfg.engine["tensor_parallel_size"] == values.get("engine", {}).get("tensorParallelSize", 1)


def test_probes_grace_period_and_gpus_follow_the_values(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for name, objects in rendered.items():
        values = VALUE_SETS[name]
        pod = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        drain = values.get("supervisor", {}).get("drainTimeoutSeconds", 60)
        assert pod["terminationGracePeriodSeconds"] > 5 + drain  # endpointDelaySeconds + drain, then the exit
        startup = c["startupProbe"]
        cold = values.get("probes", {}).get("coldStartSeconds", 60)
        assert startup["failureThreshold"] * startup["periodSeconds"] >= cold
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "supervisor"}
        assert c["lifecycle"]["preStop"]["exec"]["command"][:2] == ["opsctl", "retire"]
        assert not any("key" in a.lower() for a in c["args"])  # keys never on a command line
        tp = values.get("engine", {}).get("tensorParallelSize", 1)
        gpus = c["resources"]["limits"].get("nvidia.com/gpu")
        assert gpus == (tp if values.get("gpu", {}).get("enabled") else None)
    print("grace period, startup probe and GPU count agree with the values in", len(rendered), "value sets")


@pytest.mark.parametrize(
    "values,error",
    [
        ({"lifecycle": {"terminationGracePeriodSeconds": 30}}, "must exceed"),
        ({"autoscaling": {"keda": {"enabled": True}, "hpa": {"enabled": True}}}, "not both"),
        ({"engine": {"extra": {"port": 9000}}}, "sets this key itself"),
        ({"modelVolume": {"enabled": True}}, "modelVolume.source"),
        ({"engine": {"port": "8000"}}, "want integer"),  # values.schema.json
        ({"enigne": {"port": 8000}}, "additional properties 'enigne' not allowed"),
    ],
)
def test_chart_refuses_what_would_not_work(values: dict[str, Any], error: str) -> None:
    with pytest.raises(Exception, match=error):
        render(values)


def test_startup_threshold_covers_the_cold_start() -> None:
    for cold, period in ((4.5, 1), (60, 5), (301, 10)):
        objects = render({"probes": {"coldStartSeconds": cold, "periodSeconds": period}})
        startup = by_kind(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
        assert startup["failureThreshold"] == math.ceil(int(cold) / period) + 1
