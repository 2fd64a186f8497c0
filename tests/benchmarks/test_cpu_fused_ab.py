"""benchmarks/cpu_fused_ab.py: a small run alternates both arms on one engine and writes every sample; the
benchmark's overrides (the compiled operations, the few-row linear product) are undone after each arm."""

from __future__ import annotations

import json

import pytest

from benchmarks import cpu_fused_ab
from engine.default_model import DEFAULT_MODEL_DIR
from kernels import cpu_fused, cpu_linear


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


@pytest.mark.skipif(not cpu_linear.available(), reason="the few-row product is offered on AVX-512 hosts only")
def test_the_linear_feature_alternates_panels_and_onednn(tmp_path, monkeypatch):
    from engine.model import cpu_packing

    out = tmp_path / "ab.json"
    args = ["--model", str(DEFAULT_MODEL_DIR), "--feature", "linear", "--num-seqs", "2", "--repeats", "2"]
    calls = {"panels": 0}
    real = cpu_linear.linear

    def counted(*a, **k):
        calls["panels"] += 1
        return real(*a, **k)

    monkeypatch.setattr(cpu_linear, "linear", counted)
    saved = cpu_packing._PackedProduct.__call__
    assert cpu_fused_ab.main([*args, "--in-tokens", "8", "--out-tokens", "4", "--out", str(out)]) == 0
    assert cpu_packing._PackedProduct.__call__ is saved and calls["panels"] > 0
    data = json.loads(out.read_text())
    assert data["feature"] == "linear"
    row = data["rows"][0]
    assert all(len(row["samples"][arm]) == 2 for arm in cpu_fused_ab.LINEAR_ARMS) and row["panels_over_onednn"] > 0
