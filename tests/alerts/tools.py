"""Helpers shared by the alert and dashboard tests: where the tools are, the dashboard type check, and the queries
the dashboard and the rules contain.

    python -m tests.alerts.tools typecheck [dashboard.json]   # type-check a dashboard by hand (default: ours)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "alerts"
RULES = ALERTS / "pagekeeper-rules.yml"
RULE_TESTS = sorted((ALERTS / "tests").glob("*.yml"))
DASHBOARD = REPO / "grafana" / "pagekeeper.json"
TYPECHECK = REPO / "grafana" / "typecheck"
RUNBOOK = REPO / "docs" / "runbook.md"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_tool(name: str, how: str) -> str:
    """Path of `name`; skip the test where it is missing, except in CI (scripts/setup.sh --test installs it)."""
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} not found ({how}; scripts/setup.sh --test installs it)"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


# -- the type check ---------------------------------------------------------------------------------------------------


def tsc_path() -> Path:
    return TYPECHECK / "node_modules" / ".bin" / "tsc"


def typecheck(dashboard_text: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Compile `const dashboard: PagekeeperDashboard = <the JSON>;` with tsc --noEmit --strict in a temp dir.

    The generated file sits next to a copy of grafana/typecheck/dashboard-types.ts, with node_modules linked from
    grafana/typecheck/ so that '@grafana/schema' resolves to the installed package.
    """
    json.loads(dashboard_text)  # a JSON syntax error is reported as such, not as a TypeScript one
    with tempfile.TemporaryDirectory(prefix="dashboard-typecheck-") as tmp:
        work = Path(tmp)
        (work / "node_modules").symlink_to(TYPECHECK / "node_modules", target_is_directory=True)
        shutil.copy(TYPECHECK / "dashboard-types.ts", work / "dashboard-types.ts")
        (work / "dashboard.ts").write_text(
            "import type { GrafanaDashboard, PagekeeperDashboard } from './dashboard-types';\n\n"
            "// grafana/pagekeeper.json, verbatim:\n"
            f"const dashboard: PagekeeperDashboard = {dashboard_text.strip()};\n\n"
            "// and, as a whole, a Grafana Dashboard:\n"
            "export const asGrafana: GrafanaDashboard = dashboard;\n"
        )
        cmd = [
            str(tsc_path()),
            "--noEmit",
            "--strict",
            "--target",
            "es2022",
            "--module",
            "esnext",
            "--moduleResolution",
            "bundler",
            "--types",
            "",
            "dashboard.ts",
        ]
        return subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout)


# -- queries ----------------------------------------------------------------------------------------------------------


def panel_targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every query target of every panel (rows included, collapsed or not)."""
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for t in inner.get("targets", []):
                if "expr" in t and not t.get("hide"):
                    yield inner, t


def annotation_targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    for a in dashboard.get("annotations", {}).get("list", []):
        expr = (a.get("target") or {}).get("expr") or a.get("expr")
        if expr:
            yield a, expr


def substitute(expr: str, variables: dict[str, str], rate_interval: str = "1m") -> str:
    """Grafana's variable interpolation for a PromQL query, for the variables this dashboard uses."""
    builtins = {"__rate_interval": rate_interval, "__interval": "15s", "__range": "5m"}
    values = {**builtins, **variables}

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"unknown dashboard variable ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", one, expr)


_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "inf",
    "nan",
    "atan2",
    # aggregation operators, which may be followed by `by (...)` before their parenthesis
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
}
_TOKEN = re.compile(
    r"""(?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
      | (?P<range>\[[^\]]*\])
      | (?P<clause>\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\))
      | (?P<offset>\boffset\s+-?[0-9a-z]+)
      | (?P<selector>(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{(?P<matchers>(?:[^}"]|"(?:[^"\\]|\\.)*")*)\})
      | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<call>\s*\()?
      | (?P<other>.)
    """,
    re.X | re.S,
)


def selectors(expr: str) -> list[str]:
    """The vector selectors of a PromQL expression (metric name plus matchers), in order, without duplicates.

    A small tokenizer, enough for the queries of this repository: it drops strings outside selectors, range and
    offset modifiers, grouping clauses (`by (...)`, `on (...)`, ...), function names and keywords.
    """
    found: list[str] = []
    for m in _TOKEN.finditer(expr):
        if m.group("selector") is not None:
            name = m.group("name") or ""
            if name in _KEYWORDS:  # e.g. `... and {__name__="x"}`: not a name
                name = ""
            sel = f"{name}{{{m.group('matchers').strip()}}}"
        elif m.group("ident") is not None and not m.group("call") and m.group("ident") not in _KEYWORDS:
            sel = m.group("ident")
        else:
            continue
        if sel not in found:
            found.append(sel)
    return found


def rule_groups() -> list[dict[str, Any]]:
    import yaml

    return yaml.safe_load(RULES.read_text())["groups"]


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"] if "alert" in r]


def fast_rules_text(for_duration: str = "2s") -> str:
    """The rules with every `for:` shortened, for an integration test that cannot wait minutes."""
    text, n = re.subn(r"^(\s+for:\s*)\S+\s*$", rf"\g<1>{for_duration}", RULES.read_text(), flags=re.M)
    assert n == len(alert_rules()), (n, len(alert_rules()))
    return text


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    slug = heading.strip().lower()
    slug = re.sub(r"[^\w\- ]", "", slug)
    return slug.replace(" ", "-")


def runbook_anchors() -> set[str]:
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", RUNBOOK.read_text(), re.M)}


def main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "typecheck":
        path = Path(argv[1]) if len(argv) > 1 else DASHBOARD
        r = typecheck(path.read_text())
        print(r.stdout + r.stderr, end="")
        print("type check:", "OK" if r.returncode == 0 else f"FAILED ({r.returncode})")
        return r.returncode
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
