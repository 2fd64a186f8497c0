"""benchmarks/gemv_sweep.py in its CPU dry form (Triton's interpreter, one tiny shape): every phase runs, each
trial is checked against the reference, and the JSON names the fastest config per phase and row count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_sweep_runs_every_phase(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gemv_sweep", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = tmp_path.glob("gemv-sweep-cpu-*.json")
    result = json.loads(path.read_text())
    trials = result["trials"]
    assert not [t for t in trials if "error" in t]
    assert {t["phase"] for t in trials} == {"reference", "fp8_cuda_core", "fp8_dot", "awq"}
    assert all(max(t["rel_err"].values()) < 0.05 for t in trials)
    assert {"fp8_cuda_core:fp8_gemv:M=1", "fp8_cuda_core:fp8_gemv:M=2", "fp8_dot:fp8_gemv:M=16"} <= set(result["best"])
    assert {"awq:awq_gemv:M=1", "awq:awq_gemv:M=2"} <= set(result["best"])
