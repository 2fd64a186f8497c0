"""benchmarks/quant_profile.py's CPU dry run: two engines of the embedded model (the FP8 baseline arm and AWQ) with
their first prefill step and a decode step of every sequence profiled, and --micro --sweeps on one tiny projection
(Triton's interpreter): every code path the GPU run takes, and the JSON it writes."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("triton")

from benchmarks import quant_profile  # noqa: E402


def test_kinds_put_the_quantization_kernels_before_the_gemms():
    assert quant_profile.kind_of("_quant_tile_kernel") == "fp8_act_quant"
    assert quant_profile.kind_of("_quant_rows_kernel") == "fp8_act_quant"
    assert quant_profile.kind_of("_awq_dequant_kernel") == "awq_dequant"
    assert quant_profile.kind_of("_w4a16_kernel") == "quant_triton_gemm"
    assert quant_profile.kind_of("_decode_reduce_kernel") == "decode_attention"
    assert quant_profile.kind_of("void cutlass::device_kernel<f8f8bf16_rowwise>") == "gemm"
    assert quant_profile.kind_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert quant_profile.kind_of("Memcpy HtoD (Pinned -> Device)") == "convert_copy"
    s = quant_profile.summarise([("a_gemm", 1.0), ("a_gemm", 2.0), ("_quant_tile_kernel", 0.5)], span_ms=4.0, top=1)
    assert s["kernel_sum_ms"] == 3.5 and s["gaps_ms"] == 0.5 and s["kernels_left_out"] == 1
    assert s["by_kind"] == {"gemm": {"calls": 2, "ms": 3.0}, "fp8_act_quant": {"calls": 1, "ms": 0.5}}
    assert s["kernels"] == [{"name": "a_gemm", "kind": "gemm", "calls": 2, "ms": 3.0}]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the dry run needs Triton's interpreter (no GPU)")
def test_the_dry_run_profiles_both_steps_and_the_products(tmp_path):
    from kernels import fp8_linear, quant_cuda

    argv = ["--quick", "--configs", "fp8_weights@baseline", "awq", "--micro", "--sweeps", "--out", str(tmp_path)]
    assert quant_profile.main(argv) == 0
    assert (fp8_linear.QUANT_KERNEL, quant_cuda.FP8_FAST_ACCUM_MAX_K) == ("tile", 4096)  # the baseline arm restored
    (path,) = tmp_path.glob("quant-profile-cpu-*.json")
    result = json.loads(path.read_text())
    assert set(result["engines"]) == {"fp8_weights@baseline", "awq"}
    for row in result["engines"].values():
        assert "error" not in row, row.get("traceback_tail")
        prefill, decode = row["prefill"], row["decode"]
        assert prefill["tokens"] == 64 and prefill["seqs"] == 4  # the four 16-token prompts in one chunk
        assert decode["tokens"] == decode["seqs"] == 4
        for step in (prefill, decode):
            assert step["span_ms"] > 0 and step["kernel_sum_ms"] > 0 and step["kernels"]
            assert sum(k["ms"] for k in step["by_kind"].values()) == pytest.approx(step["kernel_sum_ms"], abs=0.01)
    (micro,) = result["micro"]
    assert micro["M"] == 4 and not [k for k in micro if k.endswith("_error")]
    for arm in ("bf16", "fp8_act_quant", "fp8_act_quant_row_kernel", "awq_default", "awq_dequant_only"):
        assert micro[f"{arm}_ms"] > 0
    assert [k for k in micro if k.startswith("fp8_act_quant_r") and k.endswith("_ms")]
    assert [k for k in micro if k.startswith("awq_dequant_") and "x" in k]
    assert micro["awq_default_rel_err"] < 1e-3 and all(
        micro[k] < 1e-3 for k in micro if k.startswith("w4a16") and k.endswith("_rel_err")
    )
