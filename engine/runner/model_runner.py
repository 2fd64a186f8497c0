"""From a scheduler plan to sampled tokens: build the step's tensors, run the model, sample.

The runner owns the KV tensors (one per layer, preallocated once) and the device; the scheduler
never touches tensors and the model never sees requests.

Nothing between building a step's inputs and reading its sampled tokens waits for the GPU: inputs
travel host -> device from pinned memory without blocking (a plain `torch.tensor(..., device=cuda)`
would wait for every queued kernel), and `launch` returns the samples still on the device.  That is
what lets the engine core queue step k+1 while the GPU computes step k (async scheduling): the
tokens step k+1 takes from step k are copied into its inputs on the device, never via the host.
Decode-only steps replay a CUDA graph (engine/runner/cuda_graphs.py) and steps with prompt tokens the piecewise
graphs (engine/runner/piecewise.py), unless `enforce_eager`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import structlog
import torch
from torch import nn

import kernels
from engine.core.plan import DevicePromptLogprobs, DeviceSample, SamplerOutput, SamplingSpec, StepPlan
from engine.kv.kv_cache_manager import blocks_for_tokens
from engine.memory.kv_alloc import allocate_kv_caches
from engine.model.interface import CausalLM
from engine.model.layers.attention import AttentionMetadata, PagedAttention
from engine.model.layers.linear import VocabEmbedding
from engine.parallel.group import SINGLE, TPGroup
from engine.runner.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from engine.runner.deferred import DeferredWork
from engine.runner.logits_adjust import SequenceRows
from engine.runner.piecewise import PieceGraphs, PiecewiseForward, supports_pieces, token_buckets
from engine.runner.sampler import SamplingBatch, sample_on_device
from engine.runner.swap_space import SwapSpace
from kernels.dense_prefill import DenseChunks, runs_of

PROMPT_LOGPROB_ROWS = 256  # prompt positions turned into full-vocabulary logprobs at a time (memory)

log = structlog.get_logger("pagekeeper.engine")


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # rows of the hidden states whose token is sampled (eager CUDA: padded, lm_head_rows)
    sampled: list[str]  # the sequences those rows belong to, in the plan's order
    sampled_out: list[int]  # how many output tokens each of them has before this step's sample
    graph_size: int | None = None  # a decode step padded to this captured batch size
    piece_rows: int | None = None  # a step with prompt tokens padded to this bucket of the piecewise graphs
    num_tokens: int = 0  # the step's real input rows (the padding follows them)
    # Input rows whose token is still on the device (async scheduling), and the row of the previous
    # step's samples that holds each.
    pending_rows: list[int] | None = None
    pending_sources: list[int] | None = None
    prompt_logprobs: list[_PromptJob] | None = None  # prompt positions whose logprobs are wanted


@dataclass
class _PromptJob:
    seq_id: str
    first_position: int  # of the first prompt token scored (the input row before it predicts it)
    first_row: int  # input row of position first_position - 1
    targets: list[int]  # the prompt tokens scored
    top_k: int


@dataclass
class _SeqState:
    """What the runner keeps of a sequence between steps (the persistent batch)."""

    sampling: SamplingSpec
    generator: torch.Generator | None  # its own random stream when it has a seed
    table: list[int]  # its block table, as the plans built it
    prompt_len: int = 0
    prompt_ids: list[int] | None = None  # kept only for prompt logprobs


def position_seed(seed: int | None, k: int) -> int:
    """The seed of output token k of a sequence seeded with `seed` (splitmix64 of the pair): its tokens depend on the
    seed and their position only, not on how many numbers earlier steps drew, so a request resumed by another
    engine core (engine/core/admission.py) draws what it would have drawn."""
    z = ((seed or 0) * 0x9E3779B97F4A7C15 + k + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def kv_cache_shape(model: CausalLM, num_blocks: int, block_size: int, device: torch.device) -> tuple[int, ...]:
    """The KV cache tensor of one layer, in the layout the device's attention kernels read (kernels/)."""
    backend = kernels.attention_backend(device)
    return tuple(backend.kv_cache_shape(num_blocks, model.num_kv_heads, block_size, model.head_dim))


def vocab_size(model: nn.Module) -> int:
    """The width of the model's logits."""
    from engine.model.layers.linear import VocabEmbedding

    return next(m.vocab_size for m in model.modules() if isinstance(m, VocabEmbedding))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def kv_bytes_per_block(model: CausalLM, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one block over every layer, K and V, in the cache's dtype (1 byte per element for fp8)."""
    elems = 2 * model.num_kv_heads * block_size * model.head_dim * model.num_layers
    return elems * torch.empty((), dtype=kv_dtype).element_size()


class StaticInputs:
    """Device buffers a captured graph reads (their addresses are baked into it), sized for the
    largest capture size and max_model_len."""

    def __init__(self, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        def buf(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = buf(max_seqs, dtype=torch.int64)
        self.positions = buf(max_seqs, dtype=torch.int64)
        self.slot_mapping = buf(max_seqs, dtype=torch.int64)
        self.seq_lens = buf(max_seqs, dtype=torch.int32)
        self.query_start_loc = buf(max_seqs + 1, dtype=torch.int32)
        self.block_tables = buf(max_seqs, max_blocks, dtype=torch.int32)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int,
        num_cpu_blocks: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        kv_dtype: torch.dtype | None = None,
        swap: SwapSpace | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.model_dtype = model_dtype = dtype
        self.kv_dtype = dtype = kv_dtype or dtype  # the cache's dtype: the model's, or float8_e4m3fn
        shape = kv_cache_shape(model, num_blocks, block_size, device)
        self.kv_caches = allocate_kv_caches(shape, dtype, device, model.num_layers)  # one allocation
        # Swap space (engine/runner/swap_space.py): written before it is read, so not zeroed; pinned on CUDA.  A
        # standby start passes the one it began pinning on a thread; otherwise the step loop allocates it, a layer
        # per unit of deferred start-up work (or all of it at the first swap).
        self._pin = device.type == "cuda"  # host copies go through pinned memory
        if swap is None:
            cpu_shape = kv_cache_shape(model, num_cpu_blocks, block_size, device)  # swap blocks: the same layout
            swap_layers = model.num_layers if num_cpu_blocks else 0
            swap = SwapSpace(cpu_shape, dtype, swap_layers, self._pin, background=False)
        self.swap = swap
        backend = kernels.attention_backend(device)
        self.backend = backend
        layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        for m in layers:
            m.backend = backend
        # Which fresh prompt chunk lengths attend over the step's own K/V on a dense kernel (None: the backend
        # has none for this model, every chunk reads the paged cache).
        dense_probe = getattr(backend, "dense_prefill_lengths", None)
        self.dense_lengths: Callable[[int], bool] | None = None
        self._attn_heads = (layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim) if layers else None
        if dense_probe is not None and self._attn_heads is not None:
            self.dense_lengths = dense_probe(model_dtype, dtype, *self._attn_heads, device)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.graphs: DecodeGraphs | None = None
        self.static: StaticInputs | None = None
        self.recent_batch: int | None = None  # sequences in the latest step: the decode graph to capture first
        # Steps with prompt tokens, up to a bucket's token count: the model's forward in pieces over fixed
        # buffers (engine/runner/piecewise.py), graphs on CUDA; None: such steps run the plain forward.
        self.pieces: PiecewiseForward | None = None
        self._seqs: dict[str, _SeqState] = {}
        self.rows = SequenceRows(vocab_size(model), device, max_num_seqs)  # penalties, logit_bias
        # The row counts an eager step's LM head is given on CUDA (see lm_head_rows); empty elsewhere.
        self.lm_head_sizes = capture_sizes(max_num_seqs) if device.type == "cuda" else []
        # Start-up work the server runs after it starts serving (engine/runner/deferred.py); empty off CUDA.
        self.deferred = DeferredWork()
        # False on tensor-parallel workers: nobody reads their samples on the host, so they skip the
        # copy to pinned memory and the logprobs (which draw no random numbers: the tokens are unchanged).
        self.reads_samples = True

    def swap_space_ready(self) -> bool:
        """No pinned allocation runs on another thread: a CUDA graph capture may run."""
        return self.swap.quiet()

    @property
    def cpu_caches(self) -> list[torch.Tensor]:
        """The swap space's per-layer blocks (waits for their allocation the first time)."""
        return self.swap.tensors()

    def close(self) -> None:
        """Unlock the swap space's pinned memory (an engine closed in a process that goes on, as the offline API's
        and the tests' do: the next engine's swap space may be mapped at the same addresses); the tensor-parallel
        runner also stops its workers here."""
        self.swap.release()

    def drop_device_state(self) -> None:
        """Forget the KV cache and the captured graphs (engine/runner/release.py): the process is leaving.  The
        cache's list is emptied in place, since the piecewise graphs and the static inputs share it."""
        self.graphs = None
        self.static = None
        self.pieces = None
        self.kv_caches.clear()
        self.deferred = DeferredWork()  # pending units refer to the graphs they would capture

    def release_graphs(self) -> None:
        """Destroy the captured decode graphs.  A graph that captured NCCL all-reduces keeps the
        communicator busy: NCCL's teardown (destroy_process_group) hangs until the graphs are gone
        (pytorch/pytorch#115388), so tensor-parallel ranks release them before leaving the group."""
        import gc

        from engine.gc_heap import thaw

        self.graphs = None
        self.static = None
        self.pieces = None
        thaw()  # graphs captured at start-up may sit in the frozen heap (engine/gc_heap.py)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def num_sequences(self) -> int:
        """Sequences whose state the runner holds (the finished ones are forgotten by the next plan)."""
        return len(self._seqs)

    def _make_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def update_state(self, plan: StepPlan) -> None:
        """Apply a plan's changes to the persistent batch: new and finished sequences, block tables."""
        for sid in plan.finished:
            self._seqs.pop(sid, None)
            self.rows.remove(sid)
        for new in plan.new_seqs:
            seed = new.sampling.seed
            generator = None if seed is None else self._make_generator(seed)
            ids = new.prompt_token_ids if new.sampling.prompt_logprobs is not None else None
            self._seqs[new.seq_id] = _SeqState(new.sampling, generator, [], new.prompt_len, ids)
            self.rows.add(new.seq_id, new.sampling, new.prompt_token_ids, self._to_device)
        for s in plan.seqs:
            table = self._seqs[s.seq_id].table
            del table[s.table_start :]
            table.extend(s.table_blocks)

    # -- host -> device ------------------------------------------------------------------------

    def _to_device(self, array: np.ndarray, into: torch.Tensor | None = None) -> torch.Tensor:
        """Copy without waiting for the GPU's queue: through pinned memory, non-blocking."""
        host = torch.from_numpy(array)
        if not self._pin:
            return host if into is None else into[: len(array)].copy_(host)
        host = host.pin_memory()
        if into is None:
            return host.to(self.device, non_blocking=True)
        return into[: len(array)].copy_(host, non_blocking=True)

    def warm_dense_prefill(self, max_tokens: int) -> int:
        """Have the dense kernel plan every shape a step of `max_tokens` can give it, now rather than in a
        step (cuDNN plans per shape: tens of milliseconds each); returns how many shapes (0: no dense path)."""
        return sum(1 for _ in self.warm_dense_prefill_steps(max_tokens))

    def warm_dense_prefill_steps(self, max_tokens: int) -> Iterator[None]:
        """`warm_dense_prefill` one shape per step of the iteration (engine/runner/deferred.py)."""
        warm = getattr(self.backend, "warm_dense_prefill_steps", None)
        if self.dense_lengths is None or warm is None or self._attn_heads is None:
            return
        yield from warm(self.model_dtype, *self._attn_heads, self.device, max_tokens)

    def lm_head_rows(self, n: int) -> int:
        """How many rows an eager step hands the LM head to sample `n`: on CUDA the smallest decode-graph size
        that holds them (past the largest, the next multiple of 64), the extra rows repeating the last one.

        cuBLAS waits for every kernel queued before it when it first meets a row count for the vocabulary-wide
        GEMM, and a mixed step samples a different number of rows nearly every time; a few repeated rows cost
        microseconds of GEMM (docs/decisions/lm-head-rows.md)."""
        return padded_size(n, self.lm_head_sizes)

    def warm_lm_head(self) -> int:
        """Meet every row count `lm_head_rows` gives, now rather than in a step; returns how many (0 off CUDA)."""
        return sum(1 for _ in self.warm_lm_head_steps())

    def warm_lm_head_steps(self) -> Iterator[None]:
        """`warm_lm_head` one row count per step of the iteration (engine/runner/deferred.py)."""
        if not self.lm_head_sizes:
            return
        width = next(m.weight.shape[1] for m in self.model.modules() if isinstance(m, VocabEmbedding))
        hidden = torch.zeros(max(self.lm_head_sizes), width, dtype=self.model_dtype, device=self.device)
        for size in self.lm_head_sizes:
            with torch.inference_mode():
                self.model.compute_logits(hidden[:size])
            torch.cuda.synchronize(self.device)
            yield

    # -- CUDA graphs -----------------------------------------------------------------------------

    def capture_decode_graphs(self, max_num_seqs: int, only_largest: bool = False) -> float:
        """Capture one decode graph per capture size (start-up profiling: only the largest, whose
        pool the others reuse); returns the seconds it took."""
        started = time.monotonic()
        for _ in self.decode_graph_steps(max_num_seqs, only_largest):
            pass
        return time.monotonic() - started

    def decode_graph_steps(self, max_num_seqs: int, only_largest: bool = False) -> Iterator[None]:
        """`capture_decode_graphs` one graph per step of the iteration (engine/runner/deferred.py), the size of
        the latest step's batch first; steps replay each graph from its capture on."""
        max_model_len = self.max_model_len
        assert self.device.type == "cuda" and max_model_len is not None
        sizes = capture_sizes(max_num_seqs)
        if only_largest:
            sizes = sizes[-1:]
        max_blocks = blocks_for_tokens(max_model_len, self.block_size)
        self.static = st = StaticInputs(max(sizes), max_blocks, self.device)
        st.query_start_loc.copy_(torch.arange(max(sizes) + 1, dtype=torch.int32, device=self.device))

        def reset() -> None:  # before each capture: replays in between left real steps' inputs here
            st.seq_lens.fill_(1)
            st.slot_mapping.fill_(-1)  # capture writes no KV

        graphs = DecodeGraphs()
        self.graphs = graphs  # each graph replays as soon as it is captured

        @torch.inference_mode()
        def forward(size: int) -> torch.Tensor:
            meta = AttentionMetadata(
                slot_mapping=st.slot_mapping[:size],
                query_start_loc=st.query_start_loc[: size + 1],
                seq_lens=st.seq_lens[:size],
                block_tables=st.block_tables[:size],
                max_query_len=1,
                max_seq_len=max_model_len,
            )
            hidden = self.model(st.input_ids[:size], st.positions[:size], self.kv_caches, meta)
            return self.model.compute_logits(hidden)

        yield from graphs.capture_steps(sizes, forward, lambda: self.recent_batch, reset)

    def capture_piece_graphs(self, max_tokens: int, only_largest: bool = False, tp: TPGroup = SINGLE) -> float:
        """Capture the piecewise graphs of steps with prompt tokens (engine/runner/piecewise.py) up to
        `max_tokens` tokens, in the decode graphs' pool when there is one; returns the seconds it took (0: the
        model offers no split).  `tp`: the group whose ranks must choose the same buckets."""
        started = time.monotonic()
        largest = [token_buckets(max_tokens)[-1]] if only_largest else None
        for _ in self.piece_graph_steps(max_tokens, largest, tp):
            pass
        return time.monotonic() - started if supports_pieces(self.model) else 0.0

    def piece_graph_steps(
        self, max_tokens: int, buckets: list[int] | None = None, tp: TPGroup = SINGLE
    ) -> Iterator[None]:
        """`capture_piece_graphs` one bucket per step of the iteration; `buckets`: exactly these (chosen by an
        earlier start), else every candidate and the cheapest kept.  Steps use the pieces once all are captured."""
        assert self.device.type == "cuda"
        if not supports_pieces(self.model):
            return
        pieces = PieceGraphs(self.model, self.kv_caches, max_tokens, self.model_dtype, self.device)
        yield from pieces.capture_steps(self.graphs.pool if self.graphs is not None else None, buckets, tp)
        self.pieces = pieces

    def use_pieces_eagerly(self, max_tokens: int) -> None:
        """Run steps with prompt tokens through the pieces without graphs (the CPU tests of the split)."""
        model = self.model
        assert supports_pieces(model), f"{type(model).__name__} offers no split at the attentions"
        self.pieces = PiecewiseForward(model, self.kv_caches, max_tokens, self.model_dtype, self.device)

    # -- a step ----------------------------------------------------------------------------------

    def prepare(self, plan: StepPlan) -> StepInputs:
        """The step's device inputs, from the plan and the block tables the runner keeps."""
        bs = self.block_size
        seqs = plan.seqs
        tables_by_seq = [self._seqs[s.seq_id].table for s in seqs]
        ones = [i for i, s in enumerate(seqs) if s.num_tokens == 1]
        decode = len(ones) == len(seqs)
        num_decodes = 0
        order = list(range(len(seqs)))
        fresh: list[int] = []
        if not decode:
            # One-token sequences first (a mixed step's decodes), then chunks that read cached context, then
            # fresh chunks of the lengths the dense kernel takes, shortest first so equal lengths share a call
            # (see AttentionMetadata).
            takes = self.dense_lengths
            if takes is not None:
                fresh = sorted(
                    (i for i, s in enumerate(seqs) if s.start == 0 and s.num_tokens > 1 and takes(s.num_tokens)),
                    key=lambda i: seqs[i].num_tokens,
                )
            chosen = set(fresh)
            order = ones + [i for i, s in enumerate(seqs) if s.num_tokens != 1 and i not in chosen] + fresh
            num_decodes = len(ones)
        graph_size = self.graphs.size_for(len(seqs)) if decode and self.graphs is not None else None
        self.recent_batch = len(seqs)
        pending_rows: list[int] = []
        pending_sources: list[int] = []
        last_row = [0] * len(seqs)  # each sequence's last input row, by plan index
        first_row = list(range(len(seqs)))  # and its first
        block_tables = [tables_by_seq[i] for i in order]
        if decode:
            ids, positions, slots, seq_lens = [], [], [], []
            for row, (s, table) in enumerate(zip(seqs, block_tables)):
                p = s.start
                if s.token_ids:
                    ids.append(s.token_ids[0])
                else:  # sampled by the step still running: filled in on the device
                    ids.append(0)
                    pending_rows.append(row)
                    pending_sources.append(s.pending_row)
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
                seq_lens.append(p + 1)
                last_row[row] = row
            ids_a = np.asarray(ids, dtype=np.int64)
            pos_a = np.asarray(positions, dtype=np.int64)
            slot_a = np.asarray(slots, dtype=np.int64)
            qsl_a = np.arange(len(seqs) + 1, dtype=np.int32)
        else:
            id_parts: list[int] = []
            pos_parts, slot_parts, qsl, seq_lens = [], [], [0], []
            for k, table in zip(order, block_tables):
                s = seqs[k]
                end = s.start + s.num_tokens
                first_row[k] = qsl[-1]
                id_parts.extend(s.token_ids)
                if s.pending_row >= 0:  # its newest token is on the device: the step's last input
                    id_parts.append(0)
                    pending_rows.append(qsl[-1] + s.num_tokens - 1)
                    pending_sources.append(s.pending_row)
                pos = np.arange(s.start, end, dtype=np.int64)
                pos_parts.append(pos)
                slot_parts.append(np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs)
                qsl.append(qsl[-1] + s.num_tokens)
                seq_lens.append(end)
                last_row[k] = qsl[-1] - 1
            ids_a = np.asarray(id_parts, dtype=np.int64)
            pos_a = np.concatenate(pos_parts)
            slot_a = np.concatenate(slot_parts)
            qsl_a = np.asarray(qsl, dtype=np.int32)
        dense = None
        if fresh:
            paged = order[num_decodes : len(order) - len(fresh)]
            dense = DenseChunks(
                runs_of([seqs[i].num_tokens for i in fresh], qsl[len(order) - len(fresh)]),
                len(fresh),
                max((seqs[i].num_tokens for i in paged), default=0),
            )
        rows: list[int] = []
        sampled: list[str] = []
        sampled_out: list[int] = []
        for k, s in enumerate(seqs):  # sample rows in the plan's order, whatever the input order
            for sid in s.sample_ids:  # n > 1: siblings sample from the same logits
                rows.append(last_row[k])
                sampled.append(sid)
                sampled_out.append(s.start + s.num_tokens - self._seqs[sid].prompt_len)
        jobs = []
        for k, s in enumerate(seqs):
            st_k = self._seqs[s.seq_id]
            if st_k.prompt_ids is None or st_k.sampling.prompt_logprobs is None:
                continue
            end = min(s.start + s.num_tokens, st_k.prompt_len - 1)  # the last position that predicts a prompt token
            if end > s.start:
                targets = st_k.prompt_ids[s.start + 1 : end + 1]
                jobs.append(_PromptJob(s.seq_id, s.start + 1, first_row[k], targets, st_k.sampling.prompt_logprobs))
        lens_a = np.asarray(seq_lens, dtype=np.int32)
        width = max(len(t) for t in block_tables)
        n = len(seqs)
        num_tokens = len(ids_a)
        st = None
        # Where the ids, positions and slots go: the fixed buffers a graph reads, or new tensors (None).
        into: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (None, None, None)
        piece_rows = None
        if graph_size is not None:
            st = self.static
            assert st is not None
            pad = graph_size - n  # padding rows: no context, no KV write, output unused
            lens_a = np.concatenate([lens_a, np.zeros(pad, np.int32)])
            width = st.block_tables.shape[1]
            n = graph_size
            into = (st.input_ids, st.positions, st.slot_mapping)
        elif self.pieces is not None:
            piece_rows = self.pieces.bucket_for(num_tokens)
            if piece_rows is not None:
                pad = piece_rows - num_tokens  # padding rows: no KV write; the attention skips them
                buf = self.pieces.buf
                into = (buf.input_ids, buf.positions, buf.slot_mapping)
        if into[0] is not None:
            ids_a = np.concatenate([ids_a, np.zeros(pad, np.int64)])
            pos_a = np.concatenate([pos_a, np.zeros(pad, np.int64)])
            slot_a = np.concatenate([slot_a, np.full(pad, -1, np.int64)])
        tables = np.zeros((n, width), dtype=np.int32)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = t
        ids_into, pos_into, slots_into = into
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slot_a, slots_into),
            query_start_loc=self._to_device(qsl_a, None) if st is None else st.query_start_loc[: n + 1],
            seq_lens=self._to_device(lens_a, None if st is None else st.seq_lens),
            block_tables=self._to_device(tables, None if st is None else st.block_tables),
            max_query_len=max(s.num_tokens for s in seqs),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            dense=dense,
        )
        head_rows = rows  # an eager step's LM head takes a row count it has met (lm_head_rows)
        if graph_size is None and rows:
            head_rows = rows + rows[-1:] * (self.lm_head_rows(len(rows)) - len(rows))
        return StepInputs(
            input_ids=self._to_device(ids_a, ids_into),
            positions=self._to_device(pos_a, pos_into),
            meta=meta,
            logits_rows=self._to_device(np.asarray(head_rows, dtype=np.int64)),
            sampled=sampled,
            sampled_out=sampled_out,
            graph_size=graph_size,
            piece_rows=piece_rows,
            num_tokens=num_tokens,
            pending_rows=pending_rows or None,
            pending_sources=pending_sources or None,
            prompt_logprobs=jobs or None,
        )

    @torch.inference_mode()
    def forward_hidden(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    @torch.inference_mode()
    def launch(self, plan: StepPlan, previous: DeviceSample | None = None) -> DeviceSample | None:
        """Queue one step on the device (block moves, forward, sampling); None when nothing samples.

        The samples' rows follow `plan.sampled_ids()`.  `previous` is the sample of the step still
        in flight, whose tokens some sequences of this step take as input (their `pending_row`);
        they are copied on the device, so this step is queued before the host has read them.
        """
        if plan.seqs:  # a unit run before this step captures the decode graph of this batch first (not the largest)
            self.recent_batch = len(plan.seqs)
        for _ in range(plan.deferred_units):
            self.deferred.run_one()
        self.update_state(plan)
        if plan.has_block_ops:
            self.apply(plan)
        if not plan.seqs:
            return None
        inputs = self.prepare(plan)
        if inputs.pending_rows is not None:
            if previous is None:
                raise RuntimeError("a scheduled token is pending but no step is in flight")
            dst = self._to_device(np.asarray(inputs.pending_rows, dtype=np.int64))
            src = self._to_device(np.asarray(inputs.pending_sources, dtype=np.int64))
            inputs.input_ids.index_copy_(0, dst, previous.tokens_on_device.index_select(0, src))
        hidden = all_logits = None
        if inputs.graph_size is not None:
            assert self.graphs is not None
            all_logits = self.graphs.replay(inputs.graph_size)
        elif inputs.piece_rows is not None:
            assert self.pieces is not None
            hidden = self.pieces.forward(inputs.piece_rows, inputs.num_tokens, inputs.meta)
        else:
            hidden = self.forward_hidden(inputs)
        # Every rank scores the prompt (the logits' all-gather is a collective), only rank 0 reads it.
        prompt = self._prompt_logprobs(inputs.prompt_logprobs, hidden, all_logits) if inputs.prompt_logprobs else None
        if not inputs.sampled:
            return None if prompt is None else self._prompt_only(prompt)
        if all_logits is not None:
            logits = all_logits[inputs.logits_rows]
        else:
            assert hidden is not None
            # the rows past the sampled ones repeat the last (lm_head_rows): cut off
            logits = self.model.compute_logits(hidden[inputs.logits_rows])[: len(inputs.sampled)]
        batch = self._sampling_batch(inputs.sampled, inputs.sampled_out)
        if plan.token_masks is not None:
            batch.mask_rows = self._to_device(np.asarray(plan.mask_rows, dtype=np.int64))
            batch.token_masks = self._to_device(plan.token_masks)
        if not self.reads_samples:
            batch.max_top_logprobs = -1
        sample = sample_on_device(logits, batch, self.generator, host_copy=self.reads_samples)
        sample.prompt_logprobs = prompt
        return sample

    def _prompt_logprobs(
        self, jobs: list[_PromptJob], hidden: torch.Tensor | None, all_logits: torch.Tensor | None
    ) -> list[DevicePromptLogprobs]:
        """Each job's prompt tokens scored by the positions before them (the model's raw distribution,
        as vLLM's prompt_logprobs), a bounded number of rows at a time."""
        out = []
        for job in jobs:
            targets = torch.tensor(job.targets, dtype=torch.int64)
            if self._pin:
                targets = targets.pin_memory().to(self.device, non_blocking=True)
            lps, ranks, ids, values = [], [], [], []
            for lo in range(0, len(job.targets), PROMPT_LOGPROB_ROWS):
                n = min(PROMPT_LOGPROB_ROWS, len(job.targets) - lo)
                rows = slice(job.first_row + lo, job.first_row + lo + n)
                if all_logits is not None:
                    logits = all_logits[rows]
                else:
                    assert hidden is not None
                    logits = self.model.compute_logits(hidden[rows])
                logprobs = torch.log_softmax(logits.float(), dim=-1)
                chosen = logprobs.gather(-1, targets[lo : lo + n, None])
                lps.append(chosen.squeeze(-1))
                ranks.append((logprobs > chosen).sum(dim=-1) + 1)
                if job.top_k > 0:
                    v, i = logprobs.topk(job.top_k, dim=-1)
                    values.append(v)
                    ids.append(i)
            out.append(
                DevicePromptLogprobs(
                    job.seq_id,
                    job.first_position,
                    torch.cat(lps),
                    torch.cat(ranks),
                    torch.cat(ids) if ids else None,
                    torch.cat(values) if values else None,
                )
            )
        return out

    def _prompt_only(self, prompt: list[DevicePromptLogprobs]) -> DeviceSample:
        """A step that samples nothing (a prompt chunk) but scored prompt tokens."""
        sample = DeviceSample(torch.empty(0, dtype=torch.int64, device=self.device), None, None, None)
        sample.prompt_logprobs = prompt
        if self.device.type == "cuda":
            sample.ready = torch.cuda.Event()
            sample.ready.record()
        return sample

    def execute(self, plan: StepPlan) -> SamplerOutput | None:
        """Run one step and wait for it; its samples in `plan.sampled_ids()` order."""
        sample = self.launch(plan)
        return None if sample is None else sample.to_host()

    def apply(self, plan: StepPlan) -> None:
        """Block movements the KV manager decided, in order: swap-out, swap-in, copy-on-write."""
        b = self.backend
        # The CPU side of a swap indexes blocks as bytes when the cache is fp8 (every torch has uint8
        # indexing; float8 indexing on CPU came later than the GPU image's torch).
        if plan.swap_out:
            src = self._to_device(np.asarray([g for g, _ in plan.swap_out], dtype=np.int64))
            dst = torch.tensor([c for _, c in plan.swap_out])
            for gpu, cpu in zip(self.kv_caches, self.cpu_caches):
                _as_bytes(cpu)[:, dst] = _as_bytes(b.gather_blocks(gpu, src).to("cpu"))
        if plan.swap_in:
            src = torch.tensor([c for c, _ in plan.swap_in])
            dst = self._to_device(np.asarray([g for _, g in plan.swap_in], dtype=np.int64))
            for gpu, cpu in zip(self.kv_caches, self.cpu_caches):
                b.scatter_blocks(gpu, _as_bytes(cpu)[:, src].view(cpu.dtype), dst)
        if plan.copies:
            src = self._to_device(np.asarray([s for s, _ in plan.copies], dtype=np.int64))
            dst = self._to_device(np.asarray([d for _, d in plan.copies], dtype=np.int64))
            for gpu in self.kv_caches:
                b.copy_blocks(gpu, src, dst)

    def _sampling_batch(self, seq_ids: list[str], num_out: list[int]) -> SamplingBatch:
        states = [self._seqs[sid] for sid in seq_ids]
        params = [st.sampling for st in states]
        for st, k in zip(states, num_out):
            if st.generator is not None:  # output token k draws from (seed, k): a resumed sequence goes on alike
                st.generator.manual_seed(position_seed(st.sampling.seed, st.sampling.seed_offset + k))
        adjust = self.rows.adjustment(params, seq_ids, num_out, self._to_device)
        wants = [p.logprobs for p in params if p.logprobs is not None]
        all_greedy = all(p.temperature == 0 for p in params)
        if all_greedy:  # the per-row tensors are only read by random sampling
            temperature = top_p = top_k = None
        else:
            temperature = self._to_device(np.asarray([p.temperature for p in params], dtype=np.float32))
            top_p = self._to_device(np.asarray([p.top_p for p in params], dtype=np.float32))
            top_k = self._to_device(np.asarray([p.top_k for p in params], dtype=np.int64))
        return SamplingBatch(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            generators=[st.generator for st in states],
            all_greedy=all_greedy,
            any_greedy=any(p.temperature == 0 for p in params),
            needs_truncation=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
            max_top_logprobs=max(wants, default=-1),
            adjust=adjust,
            rows=self.rows if adjust is not None else None,
        )
