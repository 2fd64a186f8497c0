"""benchmarks/gemv_sweep.py in its CPU dry form (Triton's interpreter, one tiny shape: K one AWQ group, N one tile):
every phase runs, each trial is checked against the reference, and the JSON names the fastest config per phase and
row count.  In this process (tests/conftest.py sets TRITON_INTERPRET before any kernel is decorated): a subprocess
paid another import of torch, and the shape before (256 x 96, 16-wide K steps) 30 s of interpreted steps."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the dry run needs Triton's interpreter (no GPU)")
def test_the_quick_sweep_runs_every_phase(tmp_path):
    from benchmarks import gemv_sweep

    assert gemv_sweep.main(["--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("gemv-sweep-cpu-*.json")
    result = json.loads(path.read_text())
    trials = result["trials"]
    assert not [t for t in trials if "error" in t]
    assert {t["phase"] for t in trials} == {"reference", "fp8_cuda_core", "fp8_dot", "awq"}
    assert all(max(t["rel_err"].values()) < 0.05 for t in trials)
    assert {"fp8_cuda_core:fp8_gemv:M=1", "fp8_cuda_core:fp8_gemv:M=2", "fp8_dot:fp8_gemv:M=16"} <= set(result["best"])
    assert {"awq:awq_gemv:M=1", "awq:awq_gemv:M=2"} <= set(result["best"])
