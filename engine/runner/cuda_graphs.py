"""CUDA graphs for decode steps: one graph per padded batch size, replayed instead of ~15 launches a layer.

A decode step of an 8B model is ~500 kernel launches; from Python that is several milliseconds of
CPU per step, which at small batches is longer than the GPU work itself.  Each graph is captured
once at start-up over the runner's static input buffers (their addresses are baked into the graph)
and covers the model's forward and the LM head; sampling stays outside (its shape varies with the
request mix).  A batch of B sequences replays the graph of the smallest capture size >= B, with
the padding rows given seq_len 0 and slot -1 (no KV is written for them, their outputs are unused).

All graphs share one memory pool, captured largest first so the smaller ones reuse its blocks (after the size that
steps need now, when capture runs under load: engine/runner/deferred.py); start-up profiling measures that pool
(engine/memory/budget.py) so it is counted in the memory plan.  A graph is replayed as soon as it is captured: a
batch whose padded size has no graph yet runs eagerly (every graph only reads the static buffers and writes its
own logits, so the ones not captured yet change nothing for those that are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 16 up to max_num_seqs (at most 512)."""
    limit = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4, 8) if s <= limit] + list(range(16, limit + 1, 16))
    if limit not in sizes:
        sizes.append(limit)
    return sorted(set(sizes))


def padded_size(n: int, sizes: list[int]) -> int:
    """The smallest of `sizes` (sorted) that holds `n`; past the largest, the next multiple of 64; `n` itself
    when there are no sizes."""
    for size in sizes:
        if size >= n:
            return size
    return -(-n // 64) * 64 if sizes else n


@dataclass
class DecodeGraph:
    size: int
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [size, vocab], written by every replay


class DecodeGraphs:
    """The captured graphs and the one pool they share."""

    def __init__(self) -> None:
        self.graphs: dict[int, DecodeGraph] = {}
        self.sizes: list[int] = []  # captured so far, sorted
        self.planned: list[int] = []  # every size that gets a graph (what a batch is padded to)
        self.pool: torch.cuda._POOL_HANDLE | None = None

    def size_for(self, batch: int) -> int | None:
        """The padded size of `batch` when its graph is captured; while it is not (captures still deferred), the
        smallest captured size that holds the batch: a decode step reads every weight whatever its rows, so more
        padding rows cost little beside an eager step (3-8x slower).  None: no captured graph holds it (eager)."""
        if not self.planned or batch > self.planned[-1]:
            return None
        size = padded_size(batch, self.planned)
        if size in self.graphs:
            return size
        return next((s for s in self.sizes if s >= batch), None)

    def capture(self, sizes: list[int], forward: Callable[[int], torch.Tensor]) -> None:
        """Capture `forward(size)` (which reads the static buffers) for every size, largest first."""
        for _ in self.capture_steps(sizes, forward):
            pass

    def capture_steps(
        self,
        sizes: list[int],
        forward: Callable[[int], torch.Tensor],
        wanted: Callable[[], int | None] | None = None,
        reset: Callable[[], None] | None = None,
    ) -> Iterator[None]:
        """`capture`, one size per step of the iteration (engine/runner/deferred.py): first the padded size of the
        batch `wanted()` names (the steps' current one) while it has no graph, else the largest left.  `reset`
        runs before each size: steps replayed between two captures left their inputs in the static buffers, and
        the eager warm-up must not write KV to their slots."""
        self.planned = sorted(sizes)
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        left = sorted(sizes, reverse=True)
        while left:
            batch = wanted() if wanted is not None else None
            want = padded_size(batch, self.planned) if batch and batch <= self.planned[-1] else None
            size = want if want in left else left[0]
            left.remove(size)
            if reset is not None:
                reset()
            # Warm-up outside the graph on a side stream: compiles the Triton kernels for this shape
            # and lets the caching allocator settle, as torch.cuda.graphs recommends.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                forward(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = forward(size)
            self.graphs[size] = DecodeGraph(size, graph, logits)
            self.sizes = sorted(self.graphs)
            yield
        torch.cuda.synchronize()

    def replay(self, size: int) -> torch.Tensor:
        g = self.graphs[size]
        g.graph.replay()
        return g.logits
