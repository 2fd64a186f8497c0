"""What the vLLM peer benchmark (benchmarks/peer_vllm_cpu.py) concludes from its raw runs: each ratio against the
vLLM binding that did better on that figure, the smaller of the checkpoints' ratios, and the verdict that a run
whose peer moved more than 10 % between repeats is to be re-run. Synthetic runs, no vLLM needed."""

from __future__ import annotations

import pytest

from benchmarks import peer_vllm_cpu as peer
from benchmarks.peer_vllm_cpu import (
    bound_cores,
    cpu_ranges,
    machine_warnings,
    peer_steadiness,
    spread,
    summarize_offline,
    summarize_serving,
    vllm_env,
)


def _off(engine: str, size: str, n: int, *tok_s: float) -> list[dict]:
    return [
        {"engine": engine, "size": size, "dtype": "bfloat16", "n": n, "repeat": i, "out_tok_s": v}
        for i, v in enumerate(tok_s)
    ]


def _serve(engine: str, rate: str, *figures: tuple[float, float, float]) -> list[dict]:
    return [
        {
            "engine": engine,
            "rate": rate,
            "repeat": i,
            "median_tpot_ms": tpot,
            "p99_tpot_ms": tpot * 1.3,
            "median_ttft_ms": ttft,
            "output_throughput": tput,
            "completed": 100,
            "failed": 0,
        }
        for i, (tpot, ttft, tput) in enumerate(figures)
    ]


def test_spread_is_range_over_median_and_unknown_for_one_repeat() -> None:
    assert spread([100.0]) is None
    assert spread([]) is None
    assert spread([90.0, 100.0, 110.0]) == pytest.approx(0.2)


def test_offline_ratio_is_against_the_faster_binding_and_the_smaller_checkpoint() -> None:
    runs = [
        # 512x8, N=64: vLLM all-cores (1,650) beats its default (1,000): the best ratio is 1,340 / 1,650
        *_off("pagekeeper", "512x8", 64, 1300, 1340, 1400),
        *_off("vllm-default", "512x8", 64, 1000, 1010, 990),
        *_off("vllm-allcores", "512x8", 64, 1650, 1640, 1660),
        # 1024x16, N=64: here the default is faster (as on a machine with many cores): 300 / 320
        *_off("pagekeeper", "1024x16", 64, 300, 300, 300),
        *_off("vllm-default", "1024x16", 64, 320, 320, 320),
        *_off("vllm-allcores", "1024x16", 64, 250, 250, 250),
        # N=256, one checkpoint: pagekeeper ahead of both
        *_off("pagekeeper", "512x8", 256, 2000, 2000, 2000),
        *_off("vllm-default", "512x8", 256, 1000, 1000, 1000),
        *_off("vllm-allcores", "512x8", 256, 1600, 1600, 1600),
    ]
    s = summarize_offline(runs)
    row = s["offline"]["512x8 bfloat16 N=64"]
    assert row["vllm_best_binding"] == "vllm-allcores"
    assert row["ratio_best"] == pytest.approx(1340 / 1650)
    assert row["ratio_default"] == pytest.approx(1340 / 1000)
    assert row["ratio_allcores"] == pytest.approx(1340 / 1650)
    assert row["vllm-default"]["spread"] == pytest.approx(20 / 1000)
    assert s["offline"]["1024x16 bfloat16 N=64"]["vllm_best_binding"] == "vllm-default"
    # the smaller of the two checkpoints' best ratios: 300 / 320 = 0.9375 > 1340 / 1650 = 0.812
    assert s["offline_ratio_best_n64"] == pytest.approx(1340 / 1650)
    assert s["offline_ratio_best_n256"] == pytest.approx(2000 / 1600)


def test_serving_ratios_pick_vllms_better_binding_per_figure() -> None:
    runs = [
        # rate 1: all-cores has the lower TPOT, the default the lower TTFT
        *_serve("pagekeeper", "1", (13.0, 58.0, 63.0), (13.2, 60.0, 63.0)),
        *_serve("vllm-default", "1", (11.0, 50.0, 64.0), (11.0, 52.0, 64.0)),
        *_serve("vllm-allcores", "1", (10.0, 55.0, 64.0), (10.0, 55.0, 64.0)),
        *_serve("pagekeeper", "4", (20.0, 74.0, 243.0), (20.0, 74.0, 243.0)),
        *_serve("vllm-default", "4", (11.6, 57.0, 249.0), (11.6, 57.0, 249.0)),
        *_serve("vllm-allcores", "4", (12.0, 60.0, 249.0), (12.0, 60.0, 249.0)),
        # unbounded: the better throughput is the higher one
        *_serve("pagekeeper", "inf", (107.0, 2027.0, 718.0), (107.0, 2027.0, 718.0)),
        *_serve("vllm-default", "inf", (112.0, 2496.0, 663.0), (112.0, 2496.0, 663.0)),
        *_serve("vllm-allcores", "inf", (90.0, 2100.0, 800.0), (90.0, 2100.0, 800.0)),
    ]
    s = summarize_serving(runs)
    assert s["serving"]["1"]["vllm_best_binding_median_tpot_ms"] == "vllm-allcores"
    assert s["serving_tpot_ratio_best_rate1"] == pytest.approx(13.1 / 10.0)
    assert s["serving_ttft_ratio_best_rate1"] == pytest.approx(59.0 / 51.0)
    assert s["serving_tpot_ratio_best_rate4"] == pytest.approx(20.0 / 11.6)
    assert s["serving_ttft_ratio_best_rate4"] == pytest.approx(74.0 / 57.0)
    assert s["serving_throughput_ratio_best_rateinf"] == pytest.approx(718.0 / 800.0)
    assert s["serving_tpot_ratio_rate1_default"] == pytest.approx(13.1 / 11.0)
    assert s["serving_tpot_ratio_rate1_allcores"] == pytest.approx(13.1 / 10.0)
    assert s["serving"]["1"]["pagekeeper"]["median_tpot_ms_spread"] == pytest.approx(0.2 / 13.1)


def test_a_peer_that_moved_over_ten_percent_is_flagged_rerun() -> None:
    pk, vl = _off("pagekeeper", "512x8", 64, 1300, 1000), _off("vllm-default", "512x8", 64, 1000, 1050)
    steady = summarize_offline([*pk, *vl])
    # pagekeeper's own 26 % move is not the peer's: only vLLM's spread decides
    v = peer_steadiness(steady["offline"], None)
    assert v["peer_moved"] is False and v["peer_spread_max"] == pytest.approx(50 / 1025)
    assert v["verdict"].startswith("peer steady")

    pk_serving = _serve("pagekeeper", "4", (20, 70, 240), (20, 70, 240))
    moved = summarize_serving([*pk_serving, *_serve("vllm-allcores", "4", (10, 50, 250), (12, 50, 250))])
    v = peer_steadiness(steady["offline"], moved["serving"])
    assert v["peer_moved"] is True
    assert v["peer_spread_max"] == pytest.approx(2 / 11)
    assert v["verdict"].startswith("re-run, don't pick") and "vllm-allcores" in v["peer_spread_where"]

    one = summarize_offline([*_off("pagekeeper", "512x8", 64, 1300), *_off("vllm-default", "512x8", 64, 1000)])
    v = peer_steadiness(one["offline"], None)
    assert v["peer_moved"] is None and "unknown" in v["verdict"]


def test_bindings_are_vllms_own_or_every_allowed_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # a caller's setting must not leak into "default"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")  # the KV budget is passed as kv_cache_memory_bytes
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 6})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env("vllm-default")
    assert vllm_env("vllm-allcores")["VLLM_CPU_OMP_THREADS_BIND"] == "0-3,6"
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_env("vllm-allcores")
    assert cpu_ranges([0, 1]) == "0-1" and cpu_ranges([3]) == "3" and cpu_ranges([0, 2, 3, 4, 9]) == "0,2-4,9"


def test_bound_cores_reads_vllms_binding_log() -> None:
    log = (
        "INFO ompmultiprocessing.py:180] OpenMP thread binding info: \n"
        "\tVLLM_CPU_OMP_THREADS_BIND='auto', auto_setup=True, skip_setup=False\n"
        "\tlocal_world_size=1, reserve_cpu_num=1\n"
        "\tlocal_rank=0, core ids=[1]\n"
        "\treserved_cpus=[0]\n"
    )
    assert bound_cores(log) == ["[1]"]
    assert bound_cores("nothing here") == []


def test_bf16_without_a_native_bf16_matmul_is_warned() -> None:
    avx2 = {"avx2": True, "avx512_bf16": False, "amx_bf16": False}
    assert machine_warnings(["bfloat16"], avx2) and "avx512_bf16" in machine_warnings(["bfloat16"], avx2)[0]
    assert machine_warnings(["float32"], avx2) == []
    assert machine_warnings(["bfloat16"], {**avx2, "avx512_bf16": True}) == []
    assert machine_warnings(["bfloat16"], {**avx2, "amx_bf16": True}) == []


def test_the_bf16_product_can_be_forced_for_an_ab_and_only_for_pagekeeper(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    import torch

    from benchmarks.peer_vllm_cpu import force_bf16_product
    from engine.model import cpu_packing

    monkeypatch.setattr(cpu_packing, "native_bf16", cpu_packing.native_bf16)  # restored after the test
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        force_bf16_product("packed")
        assert cpu_packing.product_kind(torch.bfloat16) == "packed"
    force_bf16_product("widened")
    assert cpu_packing.product_kind(torch.bfloat16) == "widened"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.peer_vllm_cpu", "--worker", "vllm", "--bf16-product", "packed"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "--bf16-product is pagekeeper's" in r.stderr


def test_the_passive_arm_is_pagekeeper_with_openmp_sleeping_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    passive, default = peer._engine_env("pagekeeper-passive"), peer._engine_env(peer.PAGEKEEPER)
    assert passive["OMP_WAIT_POLICY"] == "PASSIVE" and "OMP_WAIT_POLICY" not in default  # the engine's own default
    assert passive["PYTHONPATH"] == default["PYTHONPATH"] == str(peer.REPO)
    assert peer.SERVING_VARIANTS["pagekeeper-passive"] == []  # the same flags as the default arm
