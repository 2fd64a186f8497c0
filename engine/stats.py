"""The engine's numbers as plain data: what the core keeps per step and hands to whoever exports them.

The core (and the core's process) imports no Prometheus: the HTTP server turns a snapshot into metrics
(engine/server/metrics.py), and a remote core sends its snapshots to its front as they are (engine/loop/).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

# vLLM's buckets for the inter-token latency, so that dashboards built for vLLM read the same histogram.
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


class GapHistogram:
    """Cumulative histogram of the gaps between consecutive output tokens of a sequence, kept by the engine core.

    A step hands its gaps over grouped (in steady decoding every sequence of the batch waited the same
    step), so that recording costs one bucket lookup per distinct gap, not one per token.
    """

    def __init__(self, bounds: Sequence[float] = TPOT_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, the last one above every bound (+Inf)
        self.sum = 0.0

    def add(self, seconds: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += n
        self.sum += seconds * n


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
    # GapHistogram's state: tokens per bucket (not cumulative, +Inf last) and the sum of the gaps
    token_gap_counts: tuple[int, ...] = field(default_factory=tuple)
    token_gap_sum: float = 0.0
    # Graph captures and warm-ups still to run after serving began (engine/runner/deferred.py): until they are
    # done the engine has not settled, and spares wait (engine/loop/remote.py, opsctl/launcher.py).
    startup_work_pending: bool = False
