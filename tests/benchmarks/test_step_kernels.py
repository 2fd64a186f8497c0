"""The kernel categories and the per-kind sums of benchmarks/step_kernels.py (the GPU run feeds them real traces)."""

from __future__ import annotations

import pytest

from benchmarks.step_kernels import category, step_breakdown, summarise


@pytest.mark.parametrize(
    "name,expected",
    [
        ("_decode_kernel", "decode_attention"),
        ("_decode_reduce_kernel", "decode_attention"),
        ("_prefill_kernel", "prefill_attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "dense_attention"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", "gemm"),
        ("_write_kv_kernel", "kv_write"),
        ("_rms_norm_kernel", "norm"),
        ("_silu_mul_kernel", "silu_mul"),
        ("_rotary_kernel", "rotary"),
        ("void at::native::reduce_kernel<512, 1, ArgMaxOps>", "sampling"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", "copy"),
        ("some_new_kernel", "other"),
    ],
)
def test_category(name: str, expected: str) -> None:
    assert category(name) == expected


def test_step_breakdown_counts_the_gaps() -> None:
    out = step_breakdown([("nvjet_a", 3.0), ("_decode_kernel", 2.0), ("nvjet_b", 1.0)], span_ms=7.5)
    assert out == {"gemm": 4.0, "decode_attention": 2.0, "gaps": 1.5}


def test_summarise_sets_each_category_against_its_ceiling() -> None:
    # a decode step: 16 GB of weights at 2 TB/s is 8 ms for the GEMMs; 4 GB of KV is 2 ms for the attention
    step = dict(
        kind="decode",
        span_ms=20.0,
        kernels=[("nvjet_x", 10.0), ("_decode_kernel", 4.0), ("_rms_norm_kernel", 1.0)],
        tokens=256,
        seqs=256,
        linear_flops=1e12,
        weight_bytes=16e9,
        kv_bytes=4e9,
        bound_ms=10.0,
    )
    out = summarise([step, step], matmul_flops=1e15, copy_bytes_per_s=2e12)["decode"]
    print(out)
    assert out["steps"] == 2 and out["span_ms"] == 20.0
    assert out["ms_per_step"]["gemm"] == 10.0 and out["ms_per_step"]["decode_attention"] == 4.0
    assert out["ms_per_step"]["gaps"] == 5.0
    assert out["gemm_floor_ms"] == 8.0 and out["gemm_efficiency"] == 0.8
    assert out["attention_floor_ms"] == 2.0 and out["attention_efficiency"] == 0.5
    assert out["top_kernels"][0] == dict(name="nvjet_x", calls_per_step=1.0, ms_per_step=10.0)
    assert abs(sum(out["share_of_span"].values()) - 1.0) < 1e-3
