"""CUDA graphs for decode steps: one graph per padded batch size, replayed instead of ~15 launches a layer.

A decode step of an 8B model is ~500 kernel launches; from Python that is several milliseconds of
CPU per step, which at small batches is longer than the GPU work itself.  Each graph is captured
once at start-up over the runner's static input buffers (their addresses are baked into the graph)
and covers the model's forward and the LM head; sampling stays outside (its shape varies with the
request mix).  A batch of B sequences replays the graph of the smallest capture size >= B, with
the padding rows given seq_len 0 and slot -1 (no KV is written for them, their outputs are unused).

All graphs share one memory pool, captured largest first so the smaller ones reuse its blocks;
start-up profiling measures that pool (engine/memory/budget.py) so it is counted in the memory plan.
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
        self.sizes: list[int] = []
        self.pool = None

    def size_for(self, batch: int) -> int | None:
        """The smallest captured size that holds `batch`, or None (run eagerly)."""
        return padded_size(batch, self.sizes) if self.sizes and batch <= self.sizes[-1] else None

    def capture(self, sizes: list[int], forward: Callable[[int], torch.Tensor]) -> None:
        """Capture `forward(size)` (which reads the static buffers) for every size, largest first."""
        for _ in self.capture_steps(sizes, forward):
            pass

    def capture_steps(self, sizes: list[int], forward: Callable[[int], torch.Tensor]) -> Iterator[None]:
        """`capture`, one size per step of the iteration (engine/runner/deferred.py); `sizes` lists the captured
        ones only once all are done, so a half-captured set is never replayed."""
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in sorted(sizes, reverse=True):
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
            yield
        self.sizes = sorted(self.graphs)
        torch.cuda.synchronize()

    def replay(self, size: int) -> torch.Tensor:
        g = self.graphs[size]
        g.graph.replay()
        return g.logits
