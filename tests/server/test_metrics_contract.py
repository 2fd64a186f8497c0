"""Must-show 2: /metrics has every name of docs/architecture.md's contract and the values move with traffic.

The contract is vLLM's real names (`vllm:` prefix); with the default `--metrics-names both` every one also has
the seed's underscore twin (`vllm_`) with the same value.  The choice of names is checked in-process (what each
setting renders, what the supervisor reads from each) and a bad value is refused by the server's own parser.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.server.metrics import ALIASES, EngineMetrics
from engine.stats import EngineSnapshot
from opsctl.probes import POLL_PARAMS, SCRAPE_PARAMS, parse_engine_metrics, scrape_engine_metrics
from tests.server.harness import REPO

VLLM = [  # vLLM's own metric names, current release, that pagekeeper measures
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_max_num_generation_tokens",
    "vllm:cache_config_info",
]
OLDER_VLLM = [  # names of earlier vLLM releases for measurements pagekeeper has (older dashboards query them)
    "vllm:gpu_cache_usage_perc",
    "vllm:time_per_output_token_seconds",
    "vllm:num_requests_swapped",
    "vllm:cpu_cache_usage_perc",
]
PAGEKEEPER = [  # pagekeeper's own, in the same namespace
    "vllm:oldest_waiting_seconds",
    "vllm:prefix_cache_blocks_used",
    "vllm:prefix_cache_blocks_total",
    "vllm:prefix_cache_hit_rate",
    "vllm:request_failure_total",
    "vllm:kv_cache_token_utilization",
    "vllm:gpu_memory_allocated_bytes",
    "vllm:gpu_memory_reserved_bytes",
    "vllm:gpu_allocator_efficiency",
    "vllm:fragmentation_buffer_bytes",
    "vllm:engine_steps_total",
    "vllm:engine_draining",
]
CONTRACT = VLLM + OLDER_VLLM + PAGEKEEPER


def seed_form(name: str) -> str:
    return name.replace("vllm:", "vllm_", 1)


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


def present(names_seen: set[str], name: str) -> bool:
    return name in names_seen or name + "_count" in names_seen


def test_every_contract_metric_is_exported_and_values_move(launch):
    server = launch("--max-num-seqs", "1")
    seen = names(server.url)
    missing = [n for n in CONTRACT if not present(seen, n)]
    assert not missing, missing
    twins = [seed_form(n) for n in CONTRACT if not present(seen, seed_form(n))]
    assert not twins, twins  # the default --metrics-names both keeps the seed's forms
    print(f"{len(CONTRACT)} contract names exported, each in both forms ({len(seen)} sample names in all)")
    before = scrape(server.url)
    assert before["vllm:request_success_total{finished_reason=stop}"] == 0

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
        seen_running |= m["vllm:num_requests_running"] == 1
        seen_waiting |= m["vllm:num_requests_waiting"] == 1  # max_num_seqs=1: the second one waits
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert results == [200, 200]
    assert seen_running and seen_waiting
    after = scrape(server.url)
    assert after["vllm:request_success_total{finished_reason=length}"] == 2
    assert after["vllm:generation_tokens_total"] == 400
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    for h in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_max_num_generation_tokens",
    ):
        assert after[f"vllm:{h}_count"] == 2, h
    # one inter-token gap per token after each request's first, and they fit inside the decode times
    assert after["vllm:inter_token_latency_seconds_count"] == 2 * 199
    assert 0 < after["vllm:inter_token_latency_seconds_sum"] <= after["vllm:request_decode_time_seconds_sum"] + 1e-6
    assert after["vllm:request_generation_tokens_sum"] == after["vllm:request_max_num_generation_tokens_sum"] == 400
    prompt_tokens = after["vllm:request_prompt_tokens_sum"]
    assert prompt_tokens == after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    assert after["vllm:engine_steps_total"] > before["vllm:engine_steps_total"] + 200
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    info = [k for k in after if k.startswith("vllm:cache_config_info")]
    assert info and "block_size=16" in info[0]
    # the same measurement under every name it has: seed twins and older vLLM names
    same = {seed_form(k): v for k, v in after.items() if k.startswith("vllm:")}
    for base, aliases in ALIASES.items():
        for alias in aliases:
            for suffix in ("", "_count", "_sum"):
                if f"vllm:{base}{suffix}" in after:
                    same[f"vllm:{alias}{suffix}"] = after[f"vllm:{base}{suffix}"]
    differ = {k: (v, after[k]) for k, v in same.items() if k in after and after[k] != v}
    assert not differ, differ
    print(f"inter-token gaps: {after['vllm:inter_token_latency_seconds_count']:.0f}, prompt tokens {prompt_tokens:.0f}")

    # what the supervisor and `opsctl top` ask for (`name[]`): the same figures from a fraction of the page (but the
    # heartbeat, engine_steps_total, which an idle engine's start-up work may still move between the two scrapes)
    whole_text = httpx.get(server.url + "/metrics", timeout=10).text
    asked_text = httpx.get(server.url + "/metrics", params=SCRAPE_PARAMS, timeout=10).text
    whole, asked = scrape_engine_metrics(whole_text), scrape_engine_metrics(asked_text)
    assert asked.values.pop("steps_total") >= whole.values.pop("steps_total") and asked == whole
    assert len(asked_text) < len(whole_text) / 3

    httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 10**5}, timeout=10)
    assert scrape(server.url)["vllm:request_failure_total{reason=invalid}"] == 1


@pytest.mark.parametrize("setting", ["vllm", "seed", "both"])
def test_each_name_setting_renders_its_names_and_the_supervisor_reads_any(setting):
    metrics = EngineMetrics("m", {"block_size": "16"}, 0, names=setting, max_model_len=2048)
    metrics.update(EngineSnapshot(running=3, waiting=5, gpu_cache_usage=0.5, steps=7, preemptions=2))
    text = metrics.render().decode()
    sample_names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    has_vllm = all(present(sample_names, n) for n in CONTRACT)
    has_seed = all(present(sample_names, seed_form(n)) for n in CONTRACT)
    assert (has_vllm, has_seed) == {"vllm": (True, False), "seed": (False, True), "both": (True, True)}[setting]
    assert {n.split(":")[0].split("_")[0] for n in sample_names} == {"vllm"}  # nothing outside the two forms
    values, model = parse_engine_metrics(text)  # summed once, whichever forms are there
    assert (values["running"], values["waiting"], values["cache_usage"]) == (3, 5, 0.5), values
    assert (values["steps_total"], values["preemptions"], model) == (7, 2, "m"), values


def test_a_bad_metrics_names_value_is_refused_by_name():
    with pytest.raises(ValueError, match="metric names"):
        EngineMetrics("m", {}, 0, names="prom")  # type: ignore[arg-type]
    r = subprocess.run(
        [sys.executable, "-m", "engine.server", "--metrics-names", "prom"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO),
    )
    print(r.stderr.strip().splitlines()[-1])
    # one line naming the flag, the accepted values and the value given (the schema quotes it as JSON does)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        'error: --metrics-names must be one of vllm, seed, both, got "prom"'
    ], r.stderr


def test_the_supervisor_parses_only_the_series_it_reads(monkeypatch):
    """opsctl's scrape hands the Prometheus parser only the lines of the series it reads (the whole page took 34 ms
    of CPU, every poll): the same values, histograms and model name as the whole page parsed, and a malformed line
    of a series it does not read no longer hides the ones it does."""
    import opsctl.probes

    metrics = EngineMetrics("m", {"block_size": "16"}, 0, names="both", max_model_len=2048)
    metrics.update(EngineSnapshot(running=3, waiting=5, gpu_cache_usage=0.5, steps=7, preemptions=2))
    text = metrics.render().decode()
    read = opsctl.probes.scrape_engine_metrics(text)
    with monkeypatch.context() as m:
        m.setattr(opsctl.probes, "_wanted_lines", lambda whole: whole)
        assert opsctl.probes.scrape_engine_metrics(text) == read
    assert read.values["running"] == 3 and set(read.histograms) == {"ttft", "tpot"} and read.model == "m"
    assert opsctl.probes.scrape_engine_metrics(text + 'vllm:not_read_here{model_name="m"} {{{\n') == read
    with pytest.raises(ValueError):  # a series it reads, malformed, is still the engine's metrics unparseable
        opsctl.probes.parse_engine_metrics(text + 'vllm:num_requests_running{model_name="m"} {{{\n')


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = (s for family in text_string_to_metric_families(text) for s in family.samples)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}


@pytest.mark.parametrize("setting", ["vllm", "seed", "both"])
def test_named_series_render_alone_and_all_names_render_the_whole_page(setting):
    """`name[]` (render's `names`): every sample name asked for gives the whole page back sample for sample; the
    supervisor's names give the figures it reads from the whole page; an older vLLM name (an alias) and a name
    nobody exports give that series alone and nothing."""
    metrics = EngineMetrics("m", {"block_size": "16"}, 0, names=setting, max_model_len=2048)
    metrics.update(EngineSnapshot(running=3, waiting=5, gpu_cache_usage=0.5, steps=7, preemptions=2))
    metrics.request_finished("stop", 1.0, 1.1, 1.2, 2.0, 12, [5])
    whole = metrics.render().decode()
    everything = _samples(whole)
    assert _samples(metrics.render(sorted({name for name, _ in everything})).decode()) == everything
    asked = metrics.render(SCRAPE_PARAMS["name[]"]).decode()
    assert scrape_engine_metrics(asked) == scrape_engine_metrics(whole) and len(asked) < len(whole) / 3
    polled = metrics.render(POLL_PARAMS["name[]"]).decode()  # the supervisor's poll: the values, no histogram
    assert parse_engine_metrics(polled) == parse_engine_metrics(whole) and len(polled) < len(asked) / 1.5
    prefix = "vllm:" if setting != "seed" else "vllm_"
    alias = _samples(metrics.render([prefix + "gpu_cache_usage_perc", prefix + "no_such_series"]).decode())
    assert alias == {(prefix + "gpu_cache_usage_perc", (("model_name", "m"),)): 0.5}
    assert metrics.render(["vllm:no_such_series"]) == b""
