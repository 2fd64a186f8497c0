"""Render the Helm chart (deploy/helm/pagekeeper) as `helm template` does, for the tests.

No `helm` binary is packaged for Debian 12 or PyPI; helm-python-sdk (PyPI) is Helm's own Go SDK (v4) built as a
C library, so the templates, `.Files.Get` (the links to alerts/ and grafana/), `toToml`-free TOML rendering and
`fail` checks run exactly as under `helm template`.  By hand:

    python3 -m tests.k8s.chart [--set-json '{"gpu": {"enabled": true}}']   # the manifests, as YAML
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "pagekeeper"
RELEASE = "pk"
NAMESPACE = "llm"


def _helm() -> Any:
    """The helm_python module; a test skips where it is not installed, except in CI (setup.sh --test installs it)."""
    try:
        import helm_python
    except ImportError as e:
        message = f"helm-python-sdk is not installed ({e}); scripts/setup.sh --test installs it"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    helm_python.disable_logging()  # it logs each followed link (files/ -> alerts/, grafana/) at INFO
    return helm_python


def render_files(values: dict[str, Any] | None = None) -> dict[str, str]:
    """{template path: rendered text}, as `helm template pk deploy/helm/pagekeeper -n llm` with these values."""
    helm = _helm()
    chart = helm.Chart.load(str(CHART))
    return dict(chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True))


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The rendered Kubernetes objects (NOTES.txt and empty documents left out)."""
    objects = []
    for name, text in sorted(render_files(values).items()):
        if name.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The one object of `kind`."""
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def lint(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """`helm lint --strict` findings: {"messages": [{"severity", "path", "error"}], "errors": [...]}."""
    return dict(_helm().lint(str(CHART), values or {}, strict=True, namespace=NAMESPACE))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tests.k8s.chart")
    parser.add_argument("--set-json", default="{}", help="values as JSON, merged over values.yaml")
    args = parser.parse_args(argv)
    yaml.safe_dump_all(render(json.loads(args.set_json)), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
