"""benchmarks/tp_profile.py: rank 0's device kernels summed by kind, the GPU's idle time inside the profiled span,
and how much of the communication ran under GEMMs (the all-reduce time an overlap hid)."""

from __future__ import annotations

from benchmarks.tp_profile import kind_of, summarize


def test_kernels_are_told_apart_by_name():
    assert kind_of("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert kind_of("void c10d::symmetric_memory::two_shot_all_reduce_kernel<...>") == "communication"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "gemm"
    assert kind_of("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert kind_of("_paged_attention_decode_kernel") == "attention"
    assert kind_of("triton_rms_norm_kernel") == "other"


def test_busy_idle_and_the_communication_hidden_under_gemms():
    kernels = [  # (name, start us, end us)
        ("sm90_xmma_gemm_a", 0.0, 100.0),
        ("ncclDevKernel_AllReduce", 50.0, 150.0),  # half under the GEMM
        ("rms_norm", 150.0, 160.0),
        ("sm90_xmma_gemm_b", 200.0, 300.0),  # 40 us idle before it
        ("ncclDevKernel_AllReduce", 210.0, 230.0),  # all under the GEMM
    ]
    s = summarize(kernels)
    assert s["kernels"] == 5 and s["span_ms"] == 0.3 and s["busy_ms"] == 0.26 and s["idle_ms"] == 0.04
    assert s["kernel_ms_by_kind"] == {"communication": 0.12, "gemm": 0.2, "other": 0.01}
    assert s["communication_busy_ms"] == 0.12 and s["communication_under_gemm_ms"] == 0.07
    assert list(s["top_kernels_ms"])[0] == "ncclDevKernel_AllReduce"
    assert summarize([]) == {"kernels": 0}
