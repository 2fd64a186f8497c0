"""The periodic stats line (vLLM's "Avg prompt throughput ... GPU KV cache usage ..."), off with --disable-log-stats.

An operator tailing the log (or journald) sees throughput, queue and cache pressure without a Prometheus; it is
written from the step loop's own thread after a step, every `interval_s`, and only while the engine has done or
holds work, so an idle server's log stays quiet.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import structlog

from engine.config import ConfigError
from engine.stats import EngineSnapshot

log = structlog.get_logger("pagekeeper.stats")

DEFAULT_INTERVAL_S = 10.0
INTERVAL_ENV = "PAGEKEEPER_LOG_STATS_INTERVAL"  # seconds between lines (vLLM: VLLM_LOG_STATS_INTERVAL)


def interval_from_env() -> float:
    raw = os.environ.get(INTERVAL_ENV)
    if raw is None:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{INTERVAL_ENV}={raw!r}: give the seconds between stats lines, a number > 0")
    return value


class StatsLogger:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.snapshot = snapshot
        self.interval_s = interval_s
        self._last_t = time.monotonic()
        self._last: EngineSnapshot | None = None  # taken on the step loop's thread, as every later one
        self.lines = 0

    def __call__(self) -> None:
        now = time.monotonic()
        if self._last is None:
            self._last, self._last_t = self.snapshot(), now
            return
        elapsed = now - self._last_t
        if elapsed < self.interval_s:
            return
        s = self.snapshot()
        prev, self._last, self._last_t = self._last, s, now
        prompt = s.prompt_tokens - prev.prompt_tokens
        generated = s.generation_tokens - prev.generation_tokens
        if not (prompt or generated or s.running or s.waiting or s.swapped):
            return
        queries = s.prefix_queries - prev.prefix_queries
        hits = s.prefix_hits - prev.prefix_hits
        self.lines += 1
        log.info(
            "engine_stats",
            avg_prompt_throughput=round(prompt / elapsed, 1),
            avg_generation_throughput=round(generated / elapsed, 1),
            running=s.running,
            waiting=s.waiting,
            swapped=s.swapped,
            kv_cache_usage_perc=round(100 * s.gpu_cache_usage, 1),
            prefix_cache_hit_rate_perc=round(100 * hits / queries, 1) if queries else None,
            preemptions=s.preemptions - prev.preemptions,
        )
