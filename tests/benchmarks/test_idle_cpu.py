"""benchmarks/idle_cpu.py: one idle supervised engine's CPU, per process, from a real `opsctl start`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_one_short_repeat_reads_the_supervisor_the_front_and_the_core(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "benchmarks.idle_cpu", "--seconds", "1", "--repeats", "1", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result == json.loads(next(tmp_path.glob("idle-cpu-*.json")).read_text())
    (run,) = result["runs"]
    assert set(run) == {"supervisor", "front", "core"}, run  # the core in its own process, found under the front
    assert all(0 <= v < 100 for v in run.values()) and result["poll_interval_s"] == 0.5
    assert result["cpu_percent_total_median"] == pytest.approx(sum(result["cpu_percent_median"].values()), abs=0.01)


def test_bad_arguments_are_one_usage_error() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.idle_cpu", "--seconds", "0"],
        capture_output=True, text=True, timeout=60, cwd=str(REPO),
    )  # fmt: skip
    assert r.returncode == 2 and "--seconds" in r.stderr
