"""Steps with prompt tokens (mixed and prefill steps) as CUDA graphs of the parts between attentions.

A decode step replays one whole-model graph (engine/runner/cuda_graphs.py).  A step with prompt chunks
cannot: its attention launches depend on how its tokens split into sequences (decode rows, paged chunks,
fresh chunks on cuDNN, each with its own grid).  Run eagerly, such a step is ~11 launches a layer, and on
an H200 its host launches took as long as its kernels (benchmarks/step_phases.py, long-tailed workload,
2026-11-26: 25.2 ms of launch against 23.8 ms on the device per mixed step, 85 % of mixed steps paced by
the host), so the GPU waited for Python.

Everything but the attention itself does not care how tokens split into sequences: norms, projections,
rotary, the KV write (whose padding rows have slot -1), the MLP.  So a step of T tokens is padded to a
captured token count (`token_buckets`) and run as L + 1 graphs (embedding + layer 0 up to its attention;
layer i's output projection and MLP + layer i+1 up to its attention; the last layer's rest + the final
norm) with the L attentions launched eagerly between them over the real rows only.  The graphs read and
write fixed buffers (`PieceBuffers`): what crosses a piece boundary is copied into them at the end of a
piece, so nothing a graph allocates outlives its capture and every capture reuses the same pool blocks.

Models that offer the split (`embed`, `before_attention`, `attention`, `after_attention`, `final_norm`:
the Llama family) get it; others run such steps eagerly.  `PiecewiseForward` runs the same pieces without
graphs (the CPU tests check the split and the padding against the plain forward with it).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from engine.model.layers.attention import AttentionMetadata
from engine.runner.cuda_graphs import padded_size

# Token counts above this run eagerly: a step of 1,024 tokens keeps an 8B model's GPU busy ~20 ms, several
# times its eager launch cost, so a graph would save little there and its padding would cost compute.
MAX_GRAPH_TOKENS = 1024


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts that get graphs: every 32 up to 256, every 64 up to 512, every 128 above, capped at
    `max_tokens`, which is always one.  Padding costs at most ~1/8 of a step's tokens (8.9 % of the graph steps'
    tokens in the long-tailed H100 run of 2026-11-26), and the 16 buckets of the 8B shape captured, with the
    decode graphs, in 1.8-3.5 s (against 1.1-1.5 s for the decode graphs alone)."""
    limit = max(1, min(max_tokens, MAX_GRAPH_TOKENS))
    sizes = list(range(32, 257, 32)) + list(range(320, 513, 64)) + list(range(640, MAX_GRAPH_TOKENS + 1, 128))
    return sorted({s for s in sizes if s < limit} | {limit})


def supports_pieces(model: nn.Module) -> bool:
    """Whether the model offers its forward split at the attentions (the Llama family does, OPT does not)."""
    names = ("embed", "before_attention", "attention", "after_attention", "final_norm")
    return all(hasattr(model, name) for name in names)


class PieceBuffers:
    """What crosses a piece boundary, at fixed addresses, sized for `max_tokens` rows."""

    def __init__(self, model: nn.Module, max_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        attn = model.attention(0)
        hidden = model.shape.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

        def buf(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = buf(max_tokens, dtype=torch.int64)
        self.positions = buf(max_tokens, dtype=torch.int64)
        self.slot_mapping = buf(max_tokens, dtype=torch.int64).fill_(-1)  # -1: no KV written
        self.q = buf(max_tokens, self.num_heads, self.head_dim)
        self.k = buf(max_tokens, self.num_kv_heads, self.head_dim)
        self.v = buf(max_tokens, self.num_kv_heads, self.head_dim)
        self.attn_out = buf(max_tokens, self.num_heads, self.head_dim)
        self.x = buf(max_tokens, hidden)
        self.residual = buf(max_tokens, hidden)
        self.hidden = buf(max_tokens, hidden)  # the final norm's output: what the LM head reads


class PiecewiseForward:
    """The model's forward over `PieceBuffers`, piece by piece (no graphs: see `PieceGraphs`)."""

    def __init__(
        self,
        model: nn.Module,
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

    def capture(self, pool: object | None = None, only_largest: bool = False) -> float:
        """Capture every bucket's pieces, largest first (start-up profiling: only the largest, whose blocks the
        others reuse); returns the seconds it took."""
        started = time.monotonic()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        buckets = self.buckets[-1:] if only_largest else self.buckets
        stream = torch.cuda.Stream()
        self.graphs = {}
        with torch.inference_mode():
            for rows in sorted(buckets, reverse=True):
                self.graphs[rows] = [self._capture(index, rows, pool, stream) for index in range(self.num_layers + 1)]
        torch.cuda.synchronize()
        self.buckets = sorted(self.graphs)
        return time.monotonic() - started

    def _capture(self, index: int, rows: int, pool: object, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
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
