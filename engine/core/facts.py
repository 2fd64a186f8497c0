"""What a front needs to know of the core it talks to, as plain data: limits, the KV pool's size, start-up phases;
and what a recycle of the pool did.

A core in the same process and one in another process (engine/loop/) answer with the same value, so that the
front's validation, metrics labels and start-up log do not depend on where the core runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import ResolvedConfig


@dataclass(frozen=True)
class CoreFacts:
    config: ResolvedConfig  # every limit, as the checkpoint resolved them
    vocab_size: int
    num_blocks: int
    num_cpu_blocks: int
    eos_token_ids: frozenset[int]
    fragmentation_buffer_bytes: int
    device: str  # "cpu", "cuda:0", ...
    phases: dict[str, float] = field(default_factory=dict)  # seconds per start-up phase


@dataclass
class RecycleReport:
    """What an in-place recycle of the KV pool did (EngineCore.recycle)."""

    requeued: int  # running sequences sent back to be recomputed
    reclaimed_blocks: int  # blocks held by no known sequence (leaked), now free again
    usage_before: float  # the pool's usage before (leaked blocks included)
    seconds: float
