"""Every metric the engine exports, defined once: the contract in DESIGN.md.

Names are vLLM's (underscore form) so that existing alerts, dashboards and sidecars keep working;
every series carries `model_name`.  Gauges are refreshed once per engine step from a snapshot the
step loop takes (`EngineSnapshot`), never per token, and request histograms are observed once, when
a request finishes.  Each server gets its own registry so that tests can run several side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import generate_latest

# The *_created series double every counter's size and no dashboard or alert of ours reads them.
disable_created_metrics()

# vLLM's bucket choices, so that dashboards built for vLLM read the same histograms.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

FINISHED_REASONS = ("stop", "length", "abort")
FAILURE_REASONS = ("rejected", "invalid", "error")


@dataclass
class EngineSnapshot:
    """The engine's state after a step, read by the metrics layer (plain numbers, no references)."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0
    gpu_cache_usage: float = 0.0
    cpu_cache_usage: float = 0.0
    token_utilization: float = 1.0
    prefix_blocks_used: int = 0
    prefix_blocks_total: int = 0
    prefix_hit_rate: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    oldest_waiting_seconds: float = 0.0
    allocated_bytes: int = 0
    reserved_bytes: int = 0


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        cache_config: dict[str, str],
        fragmentation_buffer_bytes: int,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, m, registry=r)

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(name, doc, m + (extra or []), registry=r)

        self.running = gauge("vllm_num_requests_running", "Requests in the running batch")
        self.waiting = gauge("vllm_num_requests_waiting", "Requests waiting to be scheduled")
        self.swapped = gauge("vllm_num_requests_swapped", "Requests swapped out to CPU")
        self.oldest_waiting = gauge(
            "vllm_oldest_waiting_seconds",
            "Age of the oldest request waiting or swapped out (0 when none): a backlog "
            "is requests that age, not a queue that exists for an instant",
        )
        self.gpu_cache_usage = gauge(
            "vllm_gpu_cache_usage_perc", "KV blocks held by live requests / all KV blocks (0-1)"
        )
        self.cpu_cache_usage = gauge("vllm_cpu_cache_usage_perc", "Swap blocks in use / all swap blocks (0-1)")
        self.prefix_used = gauge("vllm_prefix_cache_blocks_used", "KV blocks holding cached prefixes")
        self.prefix_total = gauge("vllm_prefix_cache_blocks_total", "KV blocks the prefix cache may use")
        self.prefix_hit_rate = gauge("vllm_prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens")
        self.prefix_queries = counter("vllm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.success = counter("vllm_request_success", "Finished requests", ["finished_reason"])
        self.failure = counter("vllm_request_failure", "Requests refused or failed", ["reason"])
        self.prompt_tokens = counter("vllm_prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("vllm_generation_tokens", "Tokens generated")
        self.preemptions = counter("vllm_num_preemptions", "Sequences preempted")
        self.ttft = Histogram(
            "vllm_time_to_first_token_seconds", "Time to first token", m, buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "vllm_time_per_output_token_seconds",
            "Mean time per output token after the first",
            m,
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm_e2e_request_latency_seconds", "Arrival to finish", m, buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "vllm_request_queue_time_seconds", "Arrival to first scheduled", m, buckets=LATENCY_BUCKETS, registry=r
        )
        self.token_utilization = gauge(
            "vllm_kv_cache_token_utilization",
            "Tokens stored / token slots of allocated blocks (internal fragmentation)",
        )
        self.allocated = gauge("vllm_gpu_memory_allocated_bytes", "Device memory held by live tensors")
        self.reserved = gauge("vllm_gpu_memory_reserved_bytes", "Device memory reserved by the allocator")
        self.efficiency = gauge("vllm_gpu_allocator_efficiency", "allocated / reserved (< 0.7 is severe fragmentation)")
        self.buffer = gauge("vllm_fragmentation_buffer_bytes", "Memory kept free for allocator fragmentation")
        self.steps = counter("vllm_engine_steps", "Engine step loop iterations (the heartbeat)")
        self.draining = gauge("vllm_engine_draining", "1 while the engine drains")
        info = Gauge("vllm_cache_config_info", "KV cache configuration", m + sorted(cache_config), registry=r)
        info.labels(model_name=model_name, **cache_config).set(1)

        name = model_name
        for reason in FINISHED_REASONS:
            self.success.labels(name, reason)
        for reason in FAILURE_REASONS:
            self.failure.labels(name, reason)
        for histogram in (self.ttft, self.tpot, self.e2e, self.queue_time):
            histogram.labels(name)  # series exist (at zero) before the first request
        self.buffer.labels(name).set(fragmentation_buffer_bytes)
        self.draining.labels(name).set(0)
        self._last = EngineSnapshot()
        self.update(EngineSnapshot())

    def update(self, s: EngineSnapshot) -> None:
        """Refresh gauges and advance counters by the difference to the previous snapshot."""
        n = self.model_name
        self.running.labels(n).set(s.running)
        self.waiting.labels(n).set(s.waiting)
        self.swapped.labels(n).set(s.swapped)
        self.oldest_waiting.labels(n).set(s.oldest_waiting_seconds)
        self.gpu_cache_usage.labels(n).set(s.gpu_cache_usage)
        self.cpu_cache_usage.labels(n).set(s.cpu_cache_usage)
        self.token_utilization.labels(n).set(s.token_utilization)
        self.prefix_used.labels(n).set(s.prefix_blocks_used)
        self.prefix_total.labels(n).set(s.prefix_blocks_total)
        self.prefix_hit_rate.labels(n).set(s.prefix_hit_rate)
        self.allocated.labels(n).set(s.allocated_bytes)
        self.reserved.labels(n).set(s.reserved_bytes)
        self.efficiency.labels(n).set(s.allocated_bytes / s.reserved_bytes if s.reserved_bytes else 1.0)
        last = self._last
        for counter, now, before in (
            (self.prefix_queries, s.prefix_queries, last.prefix_queries),
            (self.prefix_hits, s.prefix_hits, last.prefix_hits),
            (self.prompt_tokens, s.prompt_tokens, last.prompt_tokens),
            (self.generation_tokens, s.generation_tokens, last.generation_tokens),
            (self.preemptions, s.preemptions, last.preemptions),
            (self.steps, s.steps, last.steps),
        ):
            counter.labels(n).inc(max(0, now - before))
        self._last = s

    def request_finished(
        self,
        reason: str,
        arrival: float,
        first_scheduled: float | None,
        first_token: float | None,
        finished: float,
        num_output_tokens: int,
    ) -> None:
        n = self.model_name
        self.success.labels(n, reason).inc()
        self.e2e.labels(n).observe(max(0.0, finished - arrival))
        if first_scheduled is not None:
            self.queue_time.labels(n).observe(max(0.0, first_scheduled - arrival))
        if first_token is not None:
            self.ttft.labels(n).observe(max(0.0, first_token - arrival))
            if num_output_tokens > 1:
                self.tpot.labels(n).observe(max(0.0, finished - first_token) / (num_output_tokens - 1))

    def request_failed(self, reason: str) -> None:
        self.failure.labels(self.model_name, reason).inc()

    def set_draining(self, draining: bool) -> None:
        self.draining.labels(self.model_name).set(1 if draining else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
