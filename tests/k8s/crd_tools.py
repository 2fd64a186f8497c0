"""Custom resources (ServiceMonitor, PrometheusRule, ScaledObject) checked against their CRDs' schemas.

The schemas come from npm: @kubernetes-models/prometheus-operator and @kubernetes-models/keda are generated from
prometheus-operator's and KEDA's Go API types, from which their CRDs are generated too.  They are pinned in
tests/k8s/crd/package-lock.json and installed by scripts/setup.sh --test (`npm ci`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.alerts.tools import in_ci

CRD_DIR = Path(__file__).resolve().parent / "crd"


def validate_custom_resources(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One result per object: {"kind", "name", "valid", "error"?}."""
    node = shutil.which("node")
    if node is None or not (CRD_DIR / "node_modules" / "@kubernetes-models").is_dir():
        message = "node or tests/k8s/crd/node_modules missing (scripts/setup.sh --test installs them)"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    r = subprocess.run(
        [node, "validate.mjs"], input=json.dumps(objects), cwd=CRD_DIR, capture_output=True, text=True, timeout=60
    )
    if r.returncode == 2 or not r.stdout.strip():
        raise AssertionError(f"validate.mjs failed ({r.returncode}): {r.stdout}{r.stderr}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
