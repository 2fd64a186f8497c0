"""Smoke test of benchmarks/throughput.py on CPU (issue 6, must-show 4): the whole benchmark runs on
the embedded model, with every key the issue names, and numbers that are at least self-consistent."""

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
    "pagekeeper_tok_s",
    "hf_static_bs64_tok_s",
    "hf_static_bs256_tok_s",
    "hf_generate_batch_tok_s",
    "copy_TBps",
    "matmul_TFLOPs",
    "roofline_tok_s",
    "roofline_fraction",
    "cold_start_s",
    "cold_start_eager_s",
)


@pytest.mark.slow
def test_quick_throughput_benchmark(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.throughput",
        "--quick",
        "--out",
        str(tmp_path),
        "--num-prompts",
        "16",
        "--input-len",
        "12",
        "--output-len",
        "12",
        "--hf-batches",
        "64",
        "256",
        "--profile-output-len",
        "4",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(REPO))
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = tmp_path.glob("throughput-cpu-*.json")
    result = json.loads(path.read_text())
    missing = [k for k in KEYS if k not in result]
    assert not missing, missing
    assert result["gpu"] == "cpu" and result["workload"]["num_prompts"] == 16
    assert result["pagekeeper_tok_s"] > 0 and result["hf_static_bs64_tok_s"] > 0
    assert result["hf_generate_batch_tok_s"] is None or result["hf_generate_batch_tok_s"] > 0
    assert 0 < result["roofline_fraction"] < 1  # nothing beats the roofline
    assert result["roofline"]["prefill_s"] > 0 and result["roofline"]["decode_s"] > 0
    assert result["cold_start_s"] > 0 and result["cold_start_eager_s"] > 0
    assert result["profile"]["top_kernels"] == [] or result["profile"]["gpu_idle_fraction"] is not None


@pytest.mark.slow
def test_quick_long_tailed_benchmark_with_structured_requests(tmp_path):
    """Issue 21's workload and bounds, and issue 16's structured-output rerun, on the embedded model."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "benchmarks.throughput", "--quick", "--workload", "long-tailed"]
    cmd += ["--out", str(tmp_path), "--num-prompts", "24", "--hf-batches", "8", "--profile-output-len", "4"]
    cmd += ["--structured-fraction", "0.25", "--skip-eager"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(REPO))
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = tmp_path.glob("throughput-cpu-long-tailed-*.json")
    result = json.loads(path.read_text())
    w = result["workload"]
    assert w["kind"] == "long-tailed" and w["num_prompts"] == 24
    assert w["prompt_len"]["max"] > w["prompt_len"]["median"]  # lengths differ
    b = result["step_bounds"]
    assert b["tokens_computed"] == w["prompt_tokens"] + w["output_tokens"] - 24
    # Neither bound is below the other in general: a bandwidth-bound prefill step (a tiny model on a CPU) costs
    # its bytes in the aware bound and only its FLOPs in the additive one.
    assert b["schedule_aware_s"] > 0 and b["additive_s"] > 0
    assert 0 < result["schedule_aware_fraction"] < 1 and 0 < result["additive_fraction"] < 1
    s = result["structured"]
    assert s["structured_requests"] == 6 and 0 < s["generated_tokens"] <= s["planned_tokens"]
    assert s["structured_completed_valid_json"] == s["structured_completed"]  # whatever completed parses
    assert result["hf_static_bs8_tok_s"] > 0 and result["pagekeeper_on_hf_requests_tok_s"] > 0
    print(
        f"long-tailed quick: {result['pagekeeper_tok_s']} tok/s, schedule-aware {result['schedule_aware_fraction']},"
        f" additive {result['additive_fraction']}, structured ratio {s['ratio_vs_plain']}"
    )
