"""Smoke test of the CPU offline benchmark (benchmarks/cpu_offline.py): `--quick` runs end to end,
writes its JSON with every documented key, and pagekeeper's greedy tokens equal transformers'.

Runs as a subprocess so that the benchmark's torch.set_num_threads does not leak into other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO_ROOT = Path(__file__).resolve().parents[2]

REQUIRED_KEYS = (
    "date",
    "device",
    "cpu_model",
    "threads",
    "torch_version",
    "transformers_version",
    "num_prompts",
    "max_tokens",
    "prompt_tokens",
    "pagekeeper_s",
    "pagekeeper_tok_s",
    "hf_loop_s",
    "hf_loop_tok_s",
    "speedup_vs_hf_loop",
    "pagekeeper_load_s",
    "command",
    "outputs_match_hf",
)
POSITIVE_KEYS = (
    "threads",
    "num_prompts",
    "max_tokens",
    "pagekeeper_s",
    "pagekeeper_tok_s",
    "hf_loop_s",
    "hf_loop_tok_s",
    "speedup_vs_hf_loop",
    "pagekeeper_load_s",
)


@pytest.mark.slow
def test_quick_run(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cpu_offline", "--quick", "--threads", "1", "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    files = list(tmp_path.glob("cpu-offline-*.json"))
    assert len(files) == 1, files
    r = json.loads(files[0].read_text())
    assert files[0].name == f"cpu-offline-{r['date']}.json"

    missing = [k for k in REQUIRED_KEYS if k not in r]
    assert not missing, missing
    assert r["device"] == "cpu"
    assert r["quick"] is True
    for k in POSITIVE_KEYS:
        assert isinstance(r[k], (int, float)) and r[k] > 0, (k, r[k])
    pt = r["prompt_tokens"]
    assert 0 < pt["min"] <= pt["mean"] <= pt["max"]
    assert pt["max"] + r["max_tokens"] <= 256
    assert (
        abs(r["pagekeeper_tok_s"] - r["num_prompts"] * r["max_tokens"] / r["pagekeeper_s"])
        < 0.05 * r["pagekeeper_tok_s"]
    )
    if "hf_static_batch_s" in r:
        assert r["hf_static_batch_s"] > 0 and r["hf_static_batch_tok_s"] > 0
    assert "benchmarks.cpu_offline" in r["command"] and "--quick" in r["command"]
    assert r["output_lengths_exact"] is True
    assert r["outputs_match_hf"] is True, r.get("mismatched_prompts")


def test_prompts_vary_and_fit() -> None:
    from benchmarks.cpu_offline import build_prompts

    prompts = build_prompts(32)
    assert len(prompts) == 32
    assert len({len(p) for p in prompts}) > 8  # varied lengths
    assert build_prompts(32) == prompts  # deterministic
