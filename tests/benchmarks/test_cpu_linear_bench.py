"""benchmarks/cpu_linear.py: one small run writes its table with every path this CPU has and the CPU's bf16
instructions."""

from __future__ import annotations

import json

from benchmarks import cpu_linear
from engine.model.cpu_packing import product_kind


def test_a_small_run_times_each_path_of_each_layer(tmp_path):
    assert cpu_linear.main(["--sizes", "128x2", "--rows", "1,4", "--min-seconds", "0", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("cpu-linear-*.json")
    data = json.loads(path.read_text())
    assert data["cpu"] and isinstance(data["bf16_instructions"], list) and data["threads"] >= 1
    kind = product_kind(__import__("torch").bfloat16)
    assert data["bf16_product"] == kind
    assert [(r["layer"], r["rows"]) for r in data["ms"]] == [
        (layer, rows) for layer in ("qkv", "o", "gate_up", "down", "lm_head") for rows in (1, 4)
    ]
    paths = {"float32", "bf16_plain"} | ({f"bf16_{kind}"} if kind else set())
    if product_kind(__import__("torch").float32) == "packed":
        paths.add("float32_packed")
    assert all(paths <= set(r) and all(r[p] > 0 for p in paths) for r in data["ms"])
    # the whole checkpoint: two layers of four projections plus the head, per path and number of rows
    for rows in ("1", "4"):
        cell = data["model_ms"]["128x2"][rows]
        assert set(cell) == paths
        mine = [r for r in data["ms"] if r["rows"] == int(rows)]
        want = sum(r["float32"] * (1 if r["layer"] == "lm_head" else 2) for r in mine)
        assert abs(cell["float32"] - want) < 1e-3


def test_the_block_size_can_be_set_and_is_recorded(tmp_path, monkeypatch):
    from engine.model import cpu_packing

    monkeypatch.setattr(cpu_packing, "WIDEN_BLOCK_BYTES", cpu_packing.WIDEN_BLOCK_BYTES)  # restored after the run
    args = ["--sizes", "128x2", "--rows", "4", "--min-seconds", "0", "--block-kib", "64", "--out", str(tmp_path)]
    assert cpu_linear.main(args) == 0
    (path,) = tmp_path.glob("cpu-linear-*-64kib.json")
    assert json.loads(path.read_text())["widen_block_bytes"] == 64 << 10
