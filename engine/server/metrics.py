"""Every metric the engine exports, defined once: the contract in docs/architecture.md.

Prometheus is the server's business: the core and its process keep plain numbers (engine/stats.py), which the
server turns into these metrics, so that neither imports prometheus_client.

Each measurement is defined once, under its base name (vLLM's, e.g. `num_requests_waiting`), and exported
under one or both name sets, picked with `--metrics-names`:

- `vllm`: vLLM's real names, `vllm:num_requests_waiting`, which vLLM's own Grafana dashboards,
  production-stack and KEDA autoscaling triggers query;
- `seed`: the seed article's underscore forms, `vllm_num_requests_waiting`, which the seed's sidecar and
  alert rules read;
- `both` (the default): a deployment upgraded from the seed's names keeps its alerts, since an alert on a
  metric that disappeared never fires and nobody notices; `vllm` halves the scrape once nothing reads them.

Both forms are written out from the same stored value at scrape time (one collector renames the families
of an inner registry), so they cannot disagree.  A few measurements also carry the name an earlier vLLM
release gave them (`ALIASES`), because dashboards built for those releases still query it.  Measurements
vLLM does not have (allocator gauges, the heartbeat, failures, drain state) follow the same two forms, so
one prefix selects every engine series.

Every series carries `model_name`.  Gauges are refreshed once per engine step from a snapshot the step
loop takes (`EngineSnapshot`), never per token; request histograms are observed once, when a request
finishes; inter-token gaps arrive per step as a histogram the engine core keeps (`GapHistogram`).  Each
server gets its own registries, so that tests can run several side by side.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, RestrictedRegistry
from prometheus_client.utils import floatToGoString

from engine.stats import TPOT_BUCKETS, EngineSnapshot

# The *_created series double every counter's size and no dashboard or alert of ours reads them.
disable_created_metrics()

MetricsNames = Literal["vllm", "seed", "both"]
PREFIXES: dict[str, tuple[str, ...]] = {"vllm": ("vllm:",), "seed": ("vllm_",), "both": ("vllm:", "vllm_")}
DEFAULT_METRICS_NAMES: MetricsNames = "both"

# Base name -> the names earlier vLLM releases gave the same measurement (still queried by their dashboards):
# vllm:gpu_cache_usage_perc until 0.9, vllm:time_per_output_token_seconds (per-token gaps) until 0.11.
ALIASES: dict[str, tuple[str, ...]] = {
    "kv_cache_usage_perc": ("gpu_cache_usage_perc",),
    "inter_token_latency_seconds": ("time_per_output_token_seconds",),
}

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
# why an engine core in its own process ended (engine/loop/remote.py): killed by a signal, exited after an error
# or on its own, or killed by its front for a silence past --health-stall-seconds
CORE_END_REASONS = ("killed", "error", "exit", "hang")


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len: vLLM's buckets for per-request token counts."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class _GapCollector(Collector):
    """The inter-token latency histogram, from the engine core's GapHistogram as of the last snapshot."""

    def __init__(self, name: str, doc: str, model_name: str, bounds: Sequence[float]) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = tuple(bounds)
        self.state: tuple[tuple[int, ...], float] = ((0,) * (len(self.bounds) + 1), 0.0)  # replaced whole

    def collect(self) -> Iterable[Metric]:
        counts, total = self.state
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), counts):
            running += n
            cumulative.append((floatToGoString(bound), float(running)))
        family.add_metric([self.model_name], cumulative, total)
        yield family


class _Named(Collector):
    """The inner registry's families under each prefix of the chosen name set, plus their aliases."""

    def __init__(self, inner: CollectorRegistry, prefixes: tuple[str, ...]) -> None:
        self.inner, self.prefixes = inner, prefixes

    def collect(self) -> Iterator[Metric]:
        return self.collect_only(None)

    def collect_only(self, names: frozenset[str] | None) -> Iterator[Metric]:
        """collect(), or only the samples named in `names` (exposed names, suffixes included), every other family
        skipped before its samples are renamed."""
        families = list(self.inner.collect() if names is None else self._inner_only(names).collect())
        for prefix in self.prefixes:
            for f in families:
                for base in (f.name, *ALIASES.get(f.name, ())):
                    name = prefix + base
                    if names is not None and not any(n.startswith(name) for n in names):
                        continue
                    renamed = Metric(name, f.documentation, f.type, f.unit)
                    renamed.samples = [s._replace(name=name + s.name[len(f.name) :]) for s in f.samples]
                    if names is not None:
                        renamed.samples = [s for s in renamed.samples if s.name in names]
                    if renamed.samples or names is None:
                        yield renamed

    def _inner_only(self, names: frozenset[str]) -> RestrictedRegistry:
        """The inner registry restricted to the samples behind `names`: prefixes off, aliases back to their names."""
        inner: set[str] = set()
        for name in names:
            for prefix in self.prefixes:
                if name.startswith(prefix):
                    base = name[len(prefix) :]
                    inner.add(base)
                    inner.update(
                        family + base[len(alias) :]
                        for family, aliases in ALIASES.items()
                        for alias in aliases
                        if base.startswith(alias)
                    )
        return self.inner.restricted_registry(inner)


class _Only:
    """What generate_latest reads for a `name[]` scrape: the named samples of one _Named."""

    def __init__(self, named: _Named, names: frozenset[str]) -> None:
        self.named, self.names = named, names

    def collect(self) -> Iterator[Metric]:
        return self.named.collect_only(self.names)


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        cache_config: dict[str, str],
        fragmentation_buffer_bytes: int,
        *,
        names: MetricsNames = DEFAULT_METRICS_NAMES,
        max_model_len: int = 4096,
    ) -> None:
        if names not in PREFIXES:
            raise ValueError(f"metric names must be one of {sorted(PREFIXES)}, got {names!r}")
        self.model_name = model_name
        self.names = names
        inner = CollectorRegistry(auto_describe=True)  # base names; never exposed as such
        self.registry = CollectorRegistry(auto_describe=True)
        self._named = _Named(inner, PREFIXES[names])
        self.registry.register(self._named)
        r, m = inner, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, m, registry=r)

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(name, doc, m + (extra or []), registry=r)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.swapped = gauge("num_requests_swapped", "Requests swapped out to CPU")
        self.oldest_waiting = gauge(
            "oldest_waiting_seconds",
            "Age of the oldest request waiting or swapped out (0 when none): a backlog "
            "is requests that age, not a queue that exists for an instant",
        )
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "KV blocks held by live requests / all KV blocks (0-1); 1 means 100 percent"
        )
        self.cpu_cache_usage = gauge("cpu_cache_usage_perc", "Swap blocks in use / all swap blocks (0-1)")
        self.prefix_used = gauge("prefix_cache_blocks_used", "KV blocks holding cached prefixes")
        self.prefix_total = gauge("prefix_cache_blocks_total", "KV blocks the prefix cache may use")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.success = counter("request_success", "Finished requests", ["finished_reason"])
        self.failure = counter("request_failure", "Requests refused or failed", ["reason"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.preemptions = counter("num_preemptions", "Sequences preempted")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token", TTFT_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per request: mean time per output token after the first (decode time / (tokens - 1))",
            TPOT_BUCKETS,
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled", LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token", LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish", LATENCY_BUCKETS)
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to finish (prefill + decode)", LATENCY_BUCKETS
        )
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request", tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated per output sequence", tokens
        )
        self.request_max_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Per request: tokens of its longest output sequence (n > 1)", tokens
        )
        self.itl = _GapCollector(
            "inter_token_latency_seconds",
            "Gap between consecutive output tokens of a sequence, once per token after the first",
            model_name,
            TPOT_BUCKETS,
        )
        r.register(self.itl)
        self.token_utilization = gauge(
            "kv_cache_token_utilization",
            "Tokens stored / token slots of allocated blocks (internal fragmentation)",
        )
        self.allocated = gauge("gpu_memory_allocated_bytes", "Device memory held by live tensors")
        self.reserved = gauge("gpu_memory_reserved_bytes", "Device memory reserved by the allocator")
        self.efficiency = gauge("gpu_allocator_efficiency", "allocated / reserved (< 0.7 is severe fragmentation)")
        self.buffer = gauge("fragmentation_buffer_bytes", "Memory kept free for allocator fragmentation")
        self.steps = counter("engine_steps", "Engine step loop iterations (the heartbeat)")
        self.draining = gauge("engine_draining", "1 while the engine drains")
        # a core in its own process (engine/loop/): its ends, and the requests the next core took over
        self.core_ends = counter(
            "engine_core_restarts", "Engine core processes that ended and were replaced", ["reason"]
        )
        self.resumed = counter(
            "requests_resumed", "Requests handed to a new engine core after theirs ended", ["reason"]
        )
        self.resume_time = Histogram(
            "request_resume_seconds",
            "From an engine core's end to a resumed request's next token",
            m + ["reason"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        info = Gauge("cache_config_info", "KV cache configuration", m + sorted(cache_config), registry=r)
        info.labels(model_name=model_name, **cache_config).set(1)

        name = model_name
        for reason in FINISHED_REASONS:
            self.success.labels(name, reason)
        for reason in FAILURE_REASONS:
            self.failure.labels(name, reason)
        for reason in CORE_END_REASONS:  # series at zero from the start, whichever --engine-core (alerts read them)
            self.core_ends.labels(name, reason)
            self.resumed.labels(name, reason)
            self.resume_time.labels(name, reason)
        for h in (
            self.ttft,
            self.tpot,
            self.e2e,
            self.queue_time,
            self.prefill_time,
            self.decode_time,
            self.inference_time,
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.request_max_generation_tokens,
        ):
            h.labels(name)  # series exist (at zero) before the first request
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
        self.kv_cache_usage.labels(n).set(s.gpu_cache_usage)
        self.cpu_cache_usage.labels(n).set(s.cpu_cache_usage)
        self.token_utilization.labels(n).set(s.token_utilization)
        self.prefix_used.labels(n).set(s.prefix_blocks_used)
        self.prefix_total.labels(n).set(s.prefix_blocks_total)
        self.prefix_hit_rate.labels(n).set(s.prefix_hit_rate)
        self.allocated.labels(n).set(s.allocated_bytes)
        self.reserved.labels(n).set(s.reserved_bytes)
        self.efficiency.labels(n).set(s.allocated_bytes / s.reserved_bytes if s.reserved_bytes else 1.0)
        if s.token_gap_counts:
            self.itl.state = (s.token_gap_counts, s.token_gap_sum)
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

    def set_live_waiting(self, waiting: int) -> None:
        """The queue read live, for a stalled loop that refreshes nothing (see admin.metrics)."""
        self.waiting.labels(self.model_name).set(waiting)

    def request_finished(
        self,
        reason: str,
        arrival: float,
        first_scheduled: float | None,
        first_token: float | None,
        finished: float,
        num_prompt_tokens: int,
        output_token_counts: Sequence[int],
    ) -> None:
        """One finished request (all its n sequences): the request histograms and the success counter."""
        n = self.model_name
        self.success.labels(n, reason).inc()
        self.e2e.labels(n).observe(max(0.0, finished - arrival))
        self.request_prompt_tokens.labels(n).observe(num_prompt_tokens)
        for count in output_token_counts:
            self.request_generation_tokens.labels(n).observe(count)
        longest = max(output_token_counts, default=0)
        self.request_max_generation_tokens.labels(n).observe(longest)
        if first_scheduled is not None:
            self.queue_time.labels(n).observe(max(0.0, first_scheduled - arrival))
            self.inference_time.labels(n).observe(max(0.0, finished - first_scheduled))
        if first_token is not None:
            self.ttft.labels(n).observe(max(0.0, first_token - arrival))
            self.decode_time.labels(n).observe(max(0.0, finished - first_token))
            if first_scheduled is not None:
                self.prefill_time.labels(n).observe(max(0.0, first_token - first_scheduled))
            if longest > 1:
                self.tpot.labels(n).observe(max(0.0, finished - first_token) / (longest - 1))

    def core_ended(self, reason: str) -> None:
        self.core_ends.labels(self.model_name, reason).inc()

    def request_resumed(self, reason: str, seconds: float) -> None:
        self.resumed.labels(self.model_name, reason).inc()
        self.resume_time.labels(self.model_name, reason).observe(seconds)

    def request_failed(self, reason: str) -> None:
        self.failure.labels(self.model_name, reason).inc()

    def set_draining(self, draining: bool) -> None:
        self.draining.labels(self.model_name).set(1 if draining else 0)

    def render(self, names: Sequence[str] = ()) -> bytes:
        """The exposition text; with `names` (sample names, as Prometheus clients' `name[]` query parameters give
        them), only those series: a supervisor polling a handful of gauges does not pay for every histogram."""
        if not names:
            return generate_latest(self.registry)
        return generate_latest(_Only(self._named, frozenset(names)))
