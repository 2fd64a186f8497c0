"""benchmarks/quant_serving.py (issue 39, must-show 4): doctor's weights line read back as bytes, the ratios over
bf16, and the --quick run on the CPU: `opsctl start` with bf16, fp8 and AWQ on the embedded model, one completion
each, `opsctl doctor`'s weights, `opsctl stop`, no process left behind."""

from __future__ import annotations

import json

import psutil
import pytest

from benchmarks import quant_serving as qs
from benchmarks.memory import LLAMA3_8B


def test_doctors_weights_line_is_read_back_as_bytes():
    line = "int32 3.50 GiB, float16 1.96 GiB = 5.46 GiB: awq int4 (group 128); 14.96 GiB unquantized in float16 (2.74x)"
    got = qs.doctor_weights(line)
    assert got["by_dtype"] == {"int32": int(3.5 * 2**30), "float16": int(1.96 * 2**30)}
    assert got["bytes"] == int(5.46 * 2**30)  # the total doctor shows, not the sum of its rounded parts
    assert got["unquantized_bytes"] == int(14.96 * 2**30)
    plain = qs.doctor_weights("bfloat16 14.96 GiB (--quantization fp8 stores the linear layers in one byte per weight)")
    assert plain == {"by_dtype": {"bfloat16": int(14.96 * 2**30)}, "bytes": int(14.96 * 2**30)}
    assert qs.doctor_weights("float8_e4m3fn 0.8 MiB, float32 0.2 MiB = 1.0 MiB: fp8")["bytes"] == int(1.0 * 2**20)


def test_the_8b_shapes_linear_layers_are_halved_and_quartered():
    """The 8B's weight bytes as the engines counted them (quantization-h100-2026-11-24.json): all weights 0.566x and
    0.357x of bf16, the linear layers alone 0.500x and 0.260x once the 16-bit embedding, LM head and norms are
    taken out."""
    rest = qs.unquantized_rest(LLAMA3_8B, 2)
    assert rest == 2 * (2 * 128256 * 4096 + 65 * 4096)
    rows = {
        name: {"doctor_weights": {"bytes": n}, "engine_weights_bytes": n}
        for name, n in (("bf16", 16060522496), ("fp8", 9086705664), ("awq", 5727854592))
    }
    r = qs.ratios(rows, rest)
    assert r["weight_ratio_fp8"] == 0.5658 and r["weight_ratio_awq"] == 0.3566
    assert r["linear_weight_ratio_fp8"] == 0.5004 and r["linear_weight_ratio_awq"] == 0.2598
    assert r["engine_weight_ratio_fp8"] == r["weight_ratio_fp8"]
    assert qs.ratios({"fp8": rows["fp8"]}, rest)["weight_ratio_fp8"] is None  # no bf16 row: no ratio


@pytest.mark.slow
def test_the_quick_run_serves_each_configuration_through_opsctl(tmp_path):
    assert qs.main(["--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("quant-serving-cpu-*.json")
    result = json.loads(path.read_text())
    configs = result["configs"]
    print({c: (r["completion"], r["doctor_weights_line"]) for c, r in configs.items()})
    for name in ("bf16", "fp8", "awq"):
        row = configs[name]
        assert row["opsctl_start"]["rc"] == 0 and row["completion"]["status"] == 200
        assert row["completion"]["tokens"] == 8 and row["completion"]["text"]
        assert row["doctor"]["rc"] == 0 and row["doctor_weights"]["bytes"] > 0
    assert set(configs["fp8"]["engine_weights_by_dtype"]) == {"float8_e4m3fn", "float32"}
    assert set(configs["awq"]["engine_weights_by_dtype"]) == {"int32", "float32"}
    assert "awq" in configs["awq"]["doctor_weights_line"] and "unquantized" in configs["fp8"]["doctor_weights_line"]
    # float32 -> one byte (fp8) and half a byte (int4) per linear weight, the embedding kept: about 1/4 and 1/8 here
    assert 0.2 < result["engine_weight_ratio_fp8"] < 0.4 and 0.1 < result["engine_weight_ratio_awq"] < 0.25
    assert result["weight_ratio_fp8"] == pytest.approx(result["engine_weight_ratio_fp8"], abs=0.05)  # doctor rounds
    left = [p for p in psutil.process_iter(["cmdline"]) if any("quant-serving-" in a for a in p.info["cmdline"] or ())]
    assert left == []  # every supervisor and engine was stopped
