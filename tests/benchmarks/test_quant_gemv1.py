"""benchmarks/quant_gemv1.py in its CPU dry form (Triton's interpreter, one tiny projection): the references and
the streaming kernel's trials run, each checked against the dequantized product, and the JSON carries the floors
and each trial's ratio to them."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the dry run needs Triton's interpreter (no GPU)")
def test_the_quick_probe_runs_and_writes_its_floors(tmp_path):
    from benchmarks import quant_gemv1

    assert quant_gemv1.main(["--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("quant-gemv1-cpu-*.json")
    result = json.loads(path.read_text())
    trials = result["trials"]
    assert not [t for t in trials if "error" in t]
    assert {t["phase"] for t in trials} == {"reference", "stream"}
    assert [t["config"].get("KIND") for t in trials if t["phase"] == "stream"] == ["stream", "stream"]
    assert all(max(t["rel_err"].values()) < 0.01 for t in trials)
    assert result["floor_ms"]["layer"] > 0 and all("over_floor" in t for t in trials)
