"""Must-show 2: /metrics has every name of DESIGN.md's contract and the values move with traffic."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

CONTRACT = [
    "vllm_num_requests_running",
    "vllm_num_requests_waiting",
    "vllm_num_requests_swapped",
    "vllm_gpu_cache_usage_perc",
    "vllm_cpu_cache_usage_perc",
    "vllm_prefix_cache_blocks_used",
    "vllm_prefix_cache_blocks_total",
    "vllm_prefix_cache_hit_rate",
    "vllm_prefix_cache_queries_total",
    "vllm_prefix_cache_hits_total",
    "vllm_request_success_total",
    "vllm_request_failure_total",
    "vllm_prompt_tokens_total",
    "vllm_generation_tokens_total",
    "vllm_num_preemptions_total",
    "vllm_time_to_first_token_seconds",
    "vllm_time_per_output_token_seconds",
    "vllm_e2e_request_latency_seconds",
    "vllm_request_queue_time_seconds",
    "vllm_kv_cache_token_utilization",
    "vllm_gpu_memory_allocated_bytes",
    "vllm_gpu_memory_reserved_bytes",
    "vllm_gpu_allocator_efficiency",
    "vllm_fragmentation_buffer_bytes",
    "vllm_engine_steps_total",
    "vllm_engine_draining",
    "vllm_cache_config_info",
]


def scrape(url: str) -> dict[str, float]:
    """{sample name with sorted labels: value}, parsed by prometheus_client's own parser."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
            assert s.labels.get("model_name") == "pagekeeper-default", s
    return out


def names(url: str) -> set[str]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_contract_metric_is_exported_and_values_move(launch):
    server = launch("--max-num-seqs", "1")
    present = names(server.url)
    missing = [n for n in CONTRACT if n not in present and n + "_count" not in present]
    assert not missing, missing
    before = scrape(server.url)
    assert before["vllm_request_success_total{finished_reason=stop}"] == 0

    body = {"model": "pagekeeper-default", "prompt": "Flat is", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code
            )
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    seen_running = seen_waiting = False
    deadline = time.monotonic() + 60
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        m = scrape(server.url)
        seen_running |= m["vllm_num_requests_running"] == 1
        seen_waiting |= m["vllm_num_requests_waiting"] == 1  # max_num_seqs=1: the second one waits
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert results == [200, 200]
    assert seen_running and seen_waiting
    after = scrape(server.url)
    assert after["vllm_request_success_total{finished_reason=length}"] == 2
    assert after["vllm_generation_tokens_total"] == 400
    assert after["vllm_prompt_tokens_total"] > before["vllm_prompt_tokens_total"]
    assert after["vllm_time_to_first_token_seconds_count"] == 2
    assert after["vllm_e2e_request_latency_seconds_count"] == 2
    assert after["vllm_request_queue_time_seconds_count"] == 2
    assert after["vllm_engine_steps_total"] > before["vllm_engine_steps_total"] + 200
    assert after["vllm_num_requests_running"] == 0 and after["vllm_gpu_cache_usage_perc"] == 0
    info = [k for k in after if k.startswith("vllm_cache_config_info")]
    assert info and "block_size=16" in info[0]

    httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 10**5}, timeout=10)
    assert scrape(server.url)["vllm_request_failure_total{reason=invalid}"] == 1
