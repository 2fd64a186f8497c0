"""benchmarks/cpu_fused_ab.py: a small run alternates both arms on one engine and writes every sample; the
benchmark's override of the compiled operations is undone after each arm."""

from __future__ import annotations

import json

from benchmarks import cpu_fused_ab
from engine.default_model import DEFAULT_MODEL_DIR
from kernels import cpu_fused


def test_a_small_run_records_both_arms(tmp_path):
    out = tmp_path / "ab.json"
    args = ["--model", str(DEFAULT_MODEL_DIR), "--num-seqs", "1,3", "--repeats", "2", "--in-tokens", "8"]
    assert cpu_fused_ab.main([*args, "--out-tokens", "4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["cpu_model"] and data["dtype"] == "float32" and data["command"].endswith(str(out))
    assert [r["num_seqs"] for r in data["rows"]] == [1, 3]
    for row in data["rows"]:
        assert all(len(row["samples"][arm]) == 2 and min(row["samples"][arm]) > 0 for arm in cpu_fused_ab.ARMS)
        assert row["compiled_over_torch"] > 0 and 0 <= row["greedy_same_share"] <= 1


def test_the_torch_arm_routes_to_the_reference_and_is_undone():
    compiled = cpu_fused._compiled
    with cpu_fused_ab.torch_ops():
        assert cpu_fused.write_kv(None, None, None, None) is False  # type: ignore[arg-type]
        assert cpu_fused._compiled is not compiled
    assert cpu_fused._compiled is compiled
