"""Steps with prompt tokens (mixed and prefill steps) as CUDA graphs of the parts between attentions.

A decode step replays one whole-model graph (engine/runner/cuda_graphs.py).  A step with prompt chunks
cannot: its attention launches depend on how its tokens split into sequences (decode rows, paged chunks,
fresh chunks on cuDNN, each with its own grid).  Run eagerly, such a step is ~11 launches a layer, and its
host launches took as long as its kernels: the GPU waited for Python (docs/decisions/piecewise-graphs.md).

Everything but the attention itself does not care how tokens split into sequences: norms, projections,
rotary, the KV write (whose padding rows have slot -1), the MLP.  So a step of T tokens is padded to a
captured token count (`token_buckets`) and run as L + 1 graphs (embedding + layer 0 up to its attention;
layer i's output projection and MLP + layer i+1 up to its attention; the last layer's rest + the final
norm) with the L attentions launched eagerly between them over the real rows only.  The graphs read and
write fixed buffers (`PieceBuffers`): what crosses a piece boundary is copied into them at the end of a
piece, so nothing a graph allocates outlives its capture and every capture reuses the same pool blocks.

Models that offer the split (a `PiecewiseLM`, engine/model/interface.py: the Llama family) get it; others
run such steps eagerly.  `PiecewiseForward` runs the same pieces without graphs (the CPU tests check the split
and the padding against the plain forward with it).
"""

from __future__ import annotations

import time
from typing import Iterator, TypeGuard

import torch
from torch import nn

from engine.model.interface import PiecewiseLM
from engine.model.layers.attention import AttentionMetadata
from engine.parallel.group import SINGLE, TPGroup
from engine.runner.cuda_graphs import padded_size

# Token counts above this run eagerly: a step of 1,024 tokens keeps an 8B model's GPU busy ~20 ms, several
# times its eager launch cost, so a graph would save little there and its padding would cost compute.
MAX_GRAPH_TOKENS = 1024


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts that get graphs: every 32 up to 256, every 64 up to 512, every 128 above, capped at
    `max_tokens`, which is always one.  Padding costs at most ~1/8 of a step's tokens, and capture stays a few
    seconds (docs/decisions/piecewise-graphs.md)."""
    limit = max(1, min(max_tokens, MAX_GRAPH_TOKENS))
    sizes = list(range(32, 257, 32)) + list(range(320, 513, 64)) + list(range(640, MAX_GRAPH_TOKENS + 1, 128))
    return sorted({s for s in sizes if s < limit} | {limit})


# Above this many tokens the projections are compute-bound, and the cost of a step's GEMMs jumps between neighbouring
# token counts with cuBLAS's choice of tiles (448 tokens cost more than 512: docs/decisions/piecewise-graphs.md).
# So the buckets above it are chosen at start-up from every multiple of 32 by what a layer's piece costs there
# (`cheapest_buckets`); below it the costs rise smoothly with the tokens and every multiple of 32 is a bucket.
MEASURED_ABOVE = 256
CANDIDATE_STEP = 32


def candidate_buckets(max_tokens: int) -> list[int]:
    """Every multiple of 32 up to the cap (`max_tokens` or MAX_GRAPH_TOKENS), and the cap itself."""
    limit = max(1, min(max_tokens, MAX_GRAPH_TOKENS))
    return sorted({s for s in range(CANDIDATE_STEP, limit, CANDIDATE_STEP)} | {limit})


def cheapest_buckets(costs: dict[int, float]) -> list[int]:
    """The token counts worth padding to: each one cheaper than every larger one.  A step then pads to the
    smallest kept count that holds it, which is the cheapest of all the candidates that hold it (a dropped count
    costs at least as much as a larger kept one).  The largest count is always kept."""
    keep, best = [], float("inf")
    for n in sorted(costs, reverse=True):
        if costs[n] < best:
            keep.append(n)
            best = costs[n]
    return sorted(keep)


def supports_pieces(model: nn.Module) -> TypeGuard[PiecewiseLM]:
    """Whether the model offers its forward split at the attentions (the Llama family does, OPT does not)."""
    return isinstance(model, PiecewiseLM)


def fused_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``[T, (Hq + 2 Hk) D]``: the one tensor that q ``[T, Hq, D]``, k and v ``[T, Hk, D]`` are consecutive views
    of, row by row (the fused QKV projection's output), or None where they are not."""
    t, d = q.shape[0], q.shape[2]
    width = (q.shape[1] + k.shape[1] + v.shape[1]) * d
    size = q.element_size()
    for part in (q, k, v):
        # a dimension of size 1 may have any stride
        if part.stride()[1:] != (d, 1) or (t > 1 and part.stride(0) != width) or part.dtype != q.dtype:
            return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * d * size or v.data_ptr() != k.data_ptr() + k.shape[1] * d * size:
        return None
    return q.as_strided((t, width), (width, 1))


class PieceBuffers:
    """What crosses a piece boundary, at fixed addresses, sized for `max_tokens` rows."""

    def __init__(self, model: PiecewiseLM, max_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        attn = model.attention(0)
        hidden = model.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

        def buf(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = buf(max_tokens, dtype=torch.int64)
        self.positions = buf(max_tokens, dtype=torch.int64)
        self.slot_mapping = buf(max_tokens, dtype=torch.int64).fill_(-1)  # -1: no KV written
        # q, k and v are views of one [T, (Hq + 2 Hk) D] buffer laid out as the fused QKV projection's output, so
        # that a piece whose q/k/v are views of that output (rotary works in place) copies them in one kernel
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        self.qkv = buf(max_tokens, (hq + 2 * hk) * d)
        self.q = self.qkv[:, : hq * d].unflatten(1, (hq, d))
        self.k = self.qkv[:, hq * d : (hq + hk) * d].unflatten(1, (hk, d))
        self.v = self.qkv[:, (hq + hk) * d :].unflatten(1, (hk, d))
        self.attn_out = buf(max_tokens, self.num_heads, self.head_dim)
        self.x = buf(max_tokens, hidden)
        self.residual = buf(max_tokens, hidden)
        self.hidden = buf(max_tokens, hidden)  # the final norm's output: what the LM head reads


class PiecewiseForward:
    """The model's forward over `PieceBuffers`, piece by piece (no graphs: see `PieceGraphs`)."""

    costs: dict[int, float] | None = None  # ms of a layer's piece per measured bucket candidate (PieceGraphs)

    def __init__(
        self,
        model: PiecewiseLM,
        kv_caches: list[torch.Tensor],
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.num_layers = len(kv_caches)
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.buf = PieceBuffers(model, self.max_tokens, dtype, device)

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest bucket that holds `num_tokens`, or None (more than the largest: run eagerly)."""
        return padded_size(num_tokens, self.buckets) if num_tokens <= self.max_tokens else None

    def piece(self, index: int, rows: int) -> None:
        """Piece `index` (0..num_layers) over the first `rows` rows of the buffers."""
        b, m = self.buf, self.model
        positions = b.positions[:rows]
        if index == 0:
            x, residual = m.embed(b.input_ids[:rows]), None
        else:
            x, residual = m.after_attention(index - 1, b.attn_out[:rows], b.residual[:rows])
        if index == self.num_layers:
            b.hidden[:rows].copy_(m.final_norm(x, residual))
            return
        q, k, v, residual = m.before_attention(index, positions, x, residual)
        m.attention(index).write(k, v, self.kv_caches[index], b.slot_mapping[:rows])
        fused = fused_rows(q, k, v)
        if fused is not None:
            b.qkv[:rows].copy_(fused)
        else:  # q/k norms (Qwen3) give q and k tensors of their own
            b.q[:rows].copy_(q)
            b.k[:rows].copy_(k)
            b.v[:rows].copy_(v)
        b.residual[:rows].copy_(residual)

    def attend(self, layer: int, num_tokens: int, meta: AttentionMetadata) -> None:
        """Layer `layer`'s attention over the real rows (the step's K/V are in the cache already)."""
        b, n = self.buf, num_tokens
        out = b.attn_out[:n]
        o = self.model.attention(layer).attend(b.q[:n], b.k[:n], b.v[:n], self.kv_caches[layer], meta, out=out)
        if o.data_ptr() != out.data_ptr():
            out.copy_(o)

    def run_piece(self, index: int, rows: int) -> None:
        self.piece(index, rows)

    @torch.inference_mode()
    def forward(self, rows: int, num_tokens: int, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[rows, hidden]`` of a step whose inputs fill the buffers' first `rows` rows (the real
        tokens first, `num_tokens` of them; padding after: id 0, position 0, slot -1)."""
        for index in range(self.num_layers + 1):
            self.run_piece(index, rows)
            if index < self.num_layers:
                self.attend(index, num_tokens, meta)
        return self.buf.hidden[:rows]


class PieceGraphs(PiecewiseForward):
    """One CUDA graph per piece and bucket, all in one memory pool (the decode graphs' when given)."""

    graphs: dict[int, list[torch.cuda.CUDAGraph]]  # by bucket, one per piece: set by `capture`

    def capture(
        self, pool: torch.cuda._POOL_HANDLE | None = None, only_largest: bool = False, tp: TPGroup = SINGLE
    ) -> float:
        """Capture every candidate's pieces, largest first, then keep the buckets `choose_buckets` picks
        (start-up profiling: only the largest, whose blocks the others reuse); returns the seconds it took."""
        started = time.monotonic()
        for _ in self.capture_steps(pool, self.buckets[-1:] if only_largest else None, tp):
            pass
        return time.monotonic() - started

    def capture_steps(
        self, pool: torch.cuda._POOL_HANDLE | None = None, buckets: list[int] | None = None, tp: TPGroup = SINGLE
    ) -> Iterator[None]:
        """Capture one bucket's pieces per step of the iteration (engine/runner/deferred.py), largest first.
        `buckets`: exactly these (the largest alone while profiling, or the ones an earlier start chose:
        engine/runner/probe_cache.py); None: every candidate, then keep those `choose_buckets` picks."""
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        chosen = buckets is not None
        stream = torch.cuda.Stream()
        graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.graphs = graphs
        for rows in sorted(buckets if buckets is not None else candidate_buckets(self.max_tokens), reverse=True):
            with torch.inference_mode():
                graphs[rows] = [self._capture(index, rows, pool, stream) for index in range(self.num_layers + 1)]
            yield
        torch.cuda.synchronize()
        self.buckets = sorted(graphs)
        if not chosen:
            self.choose_buckets(tp)

    def choose_buckets(self, tp: TPGroup = SINGLE) -> list[int]:
        """Keep every candidate up to MEASURED_ABOVE, and above it the cheapest (`cheapest_buckets`) by a layer's
        piece replayed at each candidate; the other candidates' graphs are dropped.  Tensor-parallel ranks sum
        their timings (an all-reduce), so that every rank pads a step to the same bucket, as the collectives
        inside the graphs need."""
        measured = [n for n in self.buckets if n > MEASURED_ABOVE]
        if len(measured) > 1:
            times = self.measure(measured)
            if tp.is_parallel:
                times = tp.all_reduce(times.to(self.buf.x.device)).cpu()
            self.costs = dict(zip(measured, times.tolist()))
            keep = [n for n in self.buckets if n <= MEASURED_ABOVE] + cheapest_buckets(self.costs)
            self.graphs = {n: self.graphs[n] for n in keep}
            self.buckets = keep
        return self.buckets

    @torch.inference_mode()
    def measure(self, counts: list[int], repeats: int = 4, samples: int = 3) -> torch.Tensor:
        """Milliseconds of one layer's piece graph (its output projection and MLP, the next layer's norm, QKV and
        rotary) at each captured token count: the median of `samples` timings of `repeats` back-to-back replays.
        A graph, because the same piece launched eagerly is paced by the host below ~1,000 tokens, which would
        make every count cost the same.  On random activations (a GPU runs all-zero products faster than real
        ones); the slots are all -1, so nothing is written to the cache."""
        b = self.buf
        index = 1 if self.num_layers > 1 else 0
        b.attn_out.normal_()
        b.residual.normal_()
        times = []
        for rows in counts:
            graph = self.graphs[rows][index]
            graph.replay()
            runs = []
            for _ in range(samples):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(repeats):
                    graph.replay()
                end.record()
                end.synchronize()
                runs.append(start.elapsed_time(end) / repeats)
            times.append(sorted(runs)[len(runs) // 2])
        b.attn_out.zero_()
        b.residual.zero_()
        return torch.tensor(times, dtype=torch.float64)

    def _capture(
        self, index: int, rows: int, pool: torch.cuda._POOL_HANDLE, stream: torch.cuda.Stream
    ) -> torch.cuda.CUDAGraph:
        # Warm-up outside the graph on a side stream (Triton compiles, cuBLAS picks its kernels), as
        # torch.cuda.graphs recommends; the slots are all -1, so neither run writes the cache.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.piece(index, rows)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.piece(index, rows)
        return graph

    def run_piece(self, index: int, rows: int) -> None:
        self.graphs[rows][index].replay()
