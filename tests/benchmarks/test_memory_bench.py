"""Smoke test of benchmarks/memory.py on CPU: every key the issue asks for, sane values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KEYS = (
    "gpu",
    "date",
    "token_utilization",
    "concurrency_ratio",
    "burst_requests",
    "burst_completed",
    "burst_oom_count",
    "soak_seconds",
    "soak_reserved_growth_bytes",
    "fragmentation_buffer_bytes",
    "profile_peak_reserved_bytes",
    "profile_peak_allocated_bytes",
)


@pytest.mark.slow
def test_quick_memory_benchmark(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(REPO),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = tmp_path.glob("memory-cpu-*.json")
    result = json.loads(path.read_text())
    assert all(k in result for k in KEYS)
    assert set(result["token_utilization"]) == {"8", "16", "32"}
    assert all(0 < v <= 1 for v in result["token_utilization"].values())
    assert result["token_utilization"]["8"] >= result["token_utilization"]["32"]  # smaller blocks waste less
    assert result["burst_completed"] == result["burst_requests"] > 0 and result["burst_oom_count"] == 0
    assert result["concurrency_ratio"] > 1
