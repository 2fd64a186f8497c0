"""Smoke test of benchmarks/quantization.py on CPU: the engine part of the GPU benchmark runs on the
embedded model (float32; an AWQ checkpoint written by the quantizer) and writes the issue's keys.  The
GPU numbers themselves come only from a GPU run."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_quick_quantization_benchmark(tmp_path):
    from benchmarks import quantization

    argv = ["--quick", "--configs", "bf16", "fp8_kv", "awq", "--batches", "1", "2", "--out", str(tmp_path)]
    assert quantization.main(argv) == 0
    (path,) = tmp_path.glob("quantization-cpu-*.json")
    result = json.loads(path.read_text())
    engines = result["engines"]
    print(json.dumps({k: result[k] for k in ("kv_capacity_ratio", "throughput_vs_bf16", "awq_batch1")}))
    assert result["kv_capacity_ratio"] == 4.0  # float32 -> fp8 on the CPU run (2.0 from bf16 on a GPU)
    assert all("error" not in engines[c] and engines[c]["throughput_tok_s"] > 0 for c in ("bf16", "fp8_kv", "awq"))
    assert engines["awq"]["weights_by_dtype"].keys() == {"int32", "float32"}
    assert engines["fp8_kv"]["logit_error_vs_bf16"]["argmax_agree"] > 0.9
    assert 0 < result["awq_batch1"]["fraction_of_floor"] < 1
    assert result["awq_throughput_ratio"] > 0 and result["awq_batch1_over_floor"] > 1
    assert result["fp8_throughput_ratio"] is None and result["ppl_ratio_awq"] is None  # no fp8_weights engine ran
    decode = engines["awq"]["decode"]
    assert set(decode["by_batch"]) == {"1", "2"} and decode["by_batch"]["2"]["tpot_ms"] > 0
