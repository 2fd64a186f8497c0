"""benchmarks/small_kernels.py in its CPU dry form (Triton's interpreter, batch 1, two layers): every kernel and
every split count runs once, the old arm beside the new one when `--base` names copies of the kernel files, and
the command line in the JSON leaves out the notes (which the JSON holds on their own)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("triton")

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the dry run needs Triton's interpreter (no GPU)")
def test_the_quick_run_times_both_arms_and_checks_them(tmp_path):
    from benchmarks import small_kernels

    base = tmp_path / "base"
    base.mkdir()
    for name in ("paged_attention", "fused_ops", "cache_ops"):
        shutil.copy(KERNELS / f"{name}.py", base / f"{name}.py")
    out = tmp_path / "out"
    assert small_kernels.main(["--quick", "--out", str(out), "--base", str(base), "--notes", "a dry run"]) == 0
    (path,) = out.glob("small-kernels-cpu-*.json")
    result = json.loads(path.read_text())
    assert [r["kernel"] for r in result["kernels"]] == ["norm", "rotary", "kv_write", "silu_mul", "attention"]
    assert all({"old", "new"} <= set(r) for r in result["kernels"])
    assert {r["arm"] for r in result["layer"]} == {"old", "new"}
    assert result["checks"]["attention_b1_maxabs"] == 0.0  # the same kernel in both arms
    assert "--notes" not in result["command"] and result["notes"] == "a dry run"


def test_the_notes_are_left_out_of_the_command_line():
    from benchmarks.small_kernels import _without_notes

    assert _without_notes(["--out", "d", "--notes", "x y", "--tag=-a"]) == ["--out", "d", "--tag=-a"]
    assert _without_notes(["--notes=x", "--quick"]) == ["--quick"]
