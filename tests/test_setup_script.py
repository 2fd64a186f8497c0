"""scripts/setup.sh says what it will do and how long that should take, then one line per step with what it did and
how long it took (issue 41: it printed nothing for about 65 s); a step that fails shows its output and the script
exits with that step's exit code.

The installers are stand-ins (a `python` whose `-m pip` and `-m kernels.cpu_ext` only record their arguments; `npm`,
`apt-get` and `sudo` likewise), so the script's own logic runs for real and nothing is installed on this machine:
what pip and the extension build do is covered where they are used (CI runs the real script before every suite,
tests/kernels/test_cpu_ext_cache.py builds the extension).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/usr/bin/env bash
# -m pip / -m kernels.cpu_ext: record, sleep $FAKE_SLEEP, print $FAKE_OUTPUT, exit $FAKE_RC; a distribution named in
# $FAKE_MISSING is not installed; anything else is the real interpreter
if [[ "$1" == "-m" && ( "$2" == "pip" || "$2" == "kernels.cpu_ext" ) ]]; then
  echo "$*" >> "$FAKE_LOG"
  sleep "${FAKE_SLEEP:-0}"
  [[ -n "${FAKE_OUTPUT:-}" ]] && echo "$FAKE_OUTPUT" >&2
  exit "${FAKE_RC:-0}"
fi
if [[ "$1" == "-c" && " ${FAKE_MISSING:-} " == *" ${!#} "* ]]; then exit 1; fi
exec {python} "$@"
"""

RECORDER = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$FAKE_LOG"
if [[ "$(basename "$0")" == npm ]]; then mkdir -p "$3/node_modules"; fi
"""

HEADER = re.compile(r"^setup: (\d) steps, about (\d+ s|\d+ minutes) here \(.*\)$")
RAN = re.compile(r"^setup: \[(\d)/(\d)\] (.+) \.\.\. done in (\d+(?:\.\d)?) s$")
SKIPPED = re.compile(r"^setup: \[(\d)/(\d)\] ([^.]+(?:\.\d+)*[^.]*)$")
DONE = re.compile(r"^setup: done in \d+(?:\.\d)? s \(torch .*, pagekeeper .*\)$")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the script in a folder laid out as the repository, with stand-ins first on PATH."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(FAKE_PYTHON.replace("{python}", sys.executable))
    for name in ("npm", "apt-get", "sudo", "systemctl"):
        (bin_dir / name).write_text(RECORDER)
    # the test tools the script looks for, so that it never asks for system packages here
    for name in ("promtool", "prometheus", "amtool", "systemd-analyze", "nsenter", "setpriv", "tini", "g++"):
        (bin_dir / name).write_text("#!/bin/sh\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    # checkov installed in its venv; the CRD schemas' npm packages current, the dashboard type checker's stale
    checkov = root / ".tools" / "checkov" / "bin" / "python"
    checkov.parent.mkdir(parents=True)
    checkov.write_text("#!/bin/sh\necho 3.3.30\n")
    checkov.chmod(0o755)
    for sub in ("grafana/typecheck", "tests/k8s/crd"):
        (root / sub / "node_modules").mkdir(parents=True)
        (root / sub / "package-lock.json").write_text("{}\n")
    shutil.copy(root / "tests/k8s/crd/package-lock.json", root / "tests/k8s/crd/node_modules/.pagekeeper-lock")
    return root


def _setup(checkout: Path, *args: str, **fake: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    log = checkout.parent / "calls.log"
    log.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PATH": f"{checkout.parent / 'bin'}:{os.environ['PATH']}",
        "PYTHON": str(checkout.parent / "bin" / "python"),
        "FAKE_LOG": str(log),
        **fake,
    }
    r = subprocess.run(
        ["bash", str(checkout / "scripts" / "setup.sh"), *args],
        cwd=checkout.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r, log.read_text().splitlines() if log.exists() else []


def _steps(stdout: str) -> tuple[int, list[str], list[str]]:
    """The header's step count; the lines of steps that ran and of those skipped, checked in order."""
    lines = stdout.splitlines()
    header = HEADER.match(lines[0])
    assert header, lines[0]
    total = int(header.group(1))
    ran, skipped = [], []
    for number, line in enumerate(lines[1:-1], start=1):
        m = RAN.match(line)
        if m:
            ran.append(line)
        else:
            m = SKIPPED.match(line)
            assert m, line
            skipped.append(line)
        assert (int(m.group(1)), int(m.group(2))) == (number, total), line
    assert len(lines) == total + 2, stdout
    assert DONE.match(lines[-1]), lines[-1]
    return total, ran, skipped


def test_a_fresh_environment_is_told_the_expected_duration_then_each_step_and_its_time(checkout: Path) -> None:
    r, calls = _setup(checkout, FAKE_MISSING="torch pagekeeper", FAKE_SLEEP="1.2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"about \d+ minutes here", r.stdout.splitlines()[0])
    total, ran, skipped = _steps(r.stdout)
    assert total == 3 and skipped == []
    assert ["torch" in ran[0], "pagekeeper" in ran[1], "CPU attention extension" in ran[2]] == [True] * 3
    for line in ran:  # the time each step took, as measured (each stand-in sleeps 1.2 s)
        assert 1.2 <= float(RAN.match(line).group(4)) < 60, line  # type: ignore[union-attr]
    assert calls == [
        "-m pip install --quiet --disable-pip-version-check torch==2.13.0",
        "-m pip install --quiet --disable-pip-version-check -e .",
        "-m kernels.cpu_ext",
    ]


def test_what_is_installed_already_is_kept_and_said_so(checkout: Path) -> None:
    r, calls = _setup(checkout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"about \d+ s here", r.stdout.splitlines()[0])  # seconds, not minutes
    total, ran, skipped = _steps(r.stdout)
    assert total == 3 and len(ran) == 2
    assert re.fullmatch(r"setup: \[1/3\] torch \S+ is installed: kept", skipped[0])
    assert calls == ["-m pip install --quiet --disable-pip-version-check -e .", "-m kernels.cpu_ext"]


def test_the_test_tools_steps_install_only_what_is_missing(checkout: Path) -> None:
    r, calls = _setup(checkout, "--test")
    assert r.returncode == 0, r.stdout + r.stderr
    total, ran, skipped = _steps(r.stdout)
    assert total == 7
    assert [s.split("] ", 1)[1] for s in skipped[1:]] == [
        "system packages (prometheus, alertmanager, npm, systemd, tini, g++): all there",
        "checkov 3.3.30: installed",
        "tests/k8s/crd (npm: the Kubernetes custom resources' schemas): installed",
    ]
    assert "grafana/typecheck" in ran[-1]
    npm = [c for c in calls if c.startswith("npm ")]
    assert npm == ["npm ci --prefix grafana/typecheck --no-audit --no-fund --loglevel=error"]
    assert "-m pip install --quiet --disable-pip-version-check -e .[test]" in calls
    assert not [c for c in calls if c.startswith(("apt-get", "sudo"))]
    # a second run finds it all there
    r, calls = _setup(checkout, "--test")
    assert r.returncode == 0 and not [c for c in calls if c.startswith("npm ")]


def test_a_failing_step_shows_its_output_and_exits_with_its_code(checkout: Path) -> None:
    r, calls = _setup(checkout, FAKE_RC="3", FAKE_OUTPUT="ERROR: No matching distribution found")
    assert r.returncode == 3
    lines = r.stdout.splitlines()
    failed = r"setup: \[2/3\] installing pagekeeper .* \.\.\. failed after \d+(\.\d)? s \(exit 3\):"
    assert re.fullmatch(failed, lines[-1])
    assert r.stderr == "ERROR: No matching distribution found\n"
    assert len(calls) == 1  # nothing after the failed step


def test_without_the_extension_the_runtime_set_up_warns_and_succeeds(checkout: Path) -> None:
    """Serving falls back to torch's attention; only --test requires the extension (as before)."""
    fail_ext = checkout.parent / "bin" / "python"
    fail_ext.write_text(fail_ext.read_text().replace('exit "${FAKE_RC:-0}"', '[[ "$2" == pip ]] || exit 1; exit 0'))
    r, _ = _setup(checkout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warning: the CPU attention extension was not built" in r.stderr
    r, _ = _setup(checkout, "--test")
    assert r.returncode == 1
