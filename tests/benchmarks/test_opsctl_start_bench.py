"""The `opsctl start` benchmark runs end to end: a real CLI, supervisor and engine process, timed by their creation."""

from __future__ import annotations

import json

import psutil
import pytest

from tests.benchmarks import run_benchmark

pytestmark = pytest.mark.slow


def test_one_repeat_times_each_process_and_leaves_none_running(tmp_path) -> None:
    r = run_benchmark("opsctl_start", "--repeats", "1", "--out", str(tmp_path), "--name", "run", timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "run.json").read_text()) == result
    (row,) = result["rows"]
    assert 0 < row["interpreter_s"] < row["import_cli_s"] and 0 < row["import_supervisor_cpu_s"]
    assert row["cli_to_supervisor_s"] > 0 and row["supervisor_to_engine_s"] > 0
    phases = row["cli_to_supervisor_s"] + row["supervisor_to_engine_s"]
    assert row["cli_to_engine_s"] == pytest.approx(phases, abs=0.002)
    assert set(result["heavy_modules_loaded"]) == {"opsctl.cli", "opsctl.supervisor"}
    assert result["command"].startswith("python -m benchmarks.opsctl_start --repeats 1")
    # the engine, its supervisor and the CLI were killed: none carries the benchmark's runtime dir any more
    left = [p for p in psutil.process_iter(["cmdline"]) if any("opsctl-start-" in a for a in p.info["cmdline"] or ())]
    assert left == []
