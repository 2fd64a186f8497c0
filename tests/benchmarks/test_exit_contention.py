"""benchmarks/exit_contention.py's protocol on the CPU (--quick): the leaving processes take their state, release,
exit, and every scenario reports their times and the successor's calls before and during each window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_reports_each_scenario_with_the_successors_calls(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.exit_contention", "--quick", "--out", str(tmp_path), "--victims", "2"]
    cmd += ["--pinned-gib", "0.01", "--device-gib", "0.01", "--baseline-s", "0.2", "--scenarios", "engine"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    (path,) = tmp_path.glob("exit-contention-cpu-*.json")
    result = json.loads(path.read_text())
    assert [s["scenario"] for s in result["scenarios"]] == ["engine"]
    for row in result["scenarios"]:
        assert len(row["allocate_s"]) == len(row["release_s"]) == len(row["exit_s"]) == 2
        assert all(0 <= e < 30 for e in row["exit_s"])
        before = row["during_exit"]["launch"]["before_median_ms"]
        assert before is not None and before >= 0  # the successor was timed before the exit
        assert sum(row["during_exit"][op]["during_calls"] for op in ("graph", "malloc", "launch", "pinned")) > 0


def test_sizes_and_counts_are_checked():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.exit_contention", "--quick", "--out", "/tmp", "--victims", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--victims must be >= 1" in done.stderr
