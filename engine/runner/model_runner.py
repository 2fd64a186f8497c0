"""From a scheduler plan to sampled tokens: build the step's tensors, run the model, sample.

The runner owns the KV tensors (one per layer, preallocated once) and the device; the scheduler
never touches tensors and the model never sees requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import kernels
from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput
from engine.kv.kv_cache_manager import KVOps
from engine.model.layers.attention import AttentionMetadata, PagedAttention
from engine.runner.sampler import SamplerOutput, SamplingBatch, sample


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # rows of the hidden states whose next token is sampled
    sampled: list[Request]  # the requests those rows belong to, in order


def kv_cache_shape(model: nn.Module, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (2, num_blocks, model.num_kv_heads, block_size, model.head_dim)


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    elems = 2 * model.num_kv_heads * block_size * model.head_dim * model.num_layers
    return elems * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, seed: int, num_cpu_blocks: int = 0) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = kv_cache_shape(model, num_blocks, block_size)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
        # Swap space: written before it is read, so no need to zero it; pinned for fast copies.
        pin = device.type == "cuda"
        cpu_shape = kv_cache_shape(model, num_cpu_blocks, block_size)
        self.cpu_caches = [torch.empty(cpu_shape, dtype=dtype, pin_memory=pin) for _ in range(model.num_layers)] \
            if num_cpu_blocks else []
        backend = kernels.attention_backend(device)
        self.backend = backend
        for m in model.modules():
            if isinstance(m, PagedAttention):
                m.backend = backend
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def prepare(self, plan: SchedulerOutput, block_tables: list[list[int]]) -> StepInputs:
        bs = self.block_size
        ids: list[int] = []
        pos_parts, slot_parts = [], []
        qsl, seq_lens, rows, sampled = [0], [], [], []
        for s, table in zip(plan.seqs, block_tables):
            req = s.request
            end = s.start + s.num_tokens
            ids.extend(req.token_ids(s.start, end))
            pos = np.arange(s.start, end, dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs)
            qsl.append(qsl[-1] + s.num_tokens)
            seq_lens.append(end)
            if s.samples:
                rows.append(qsl[-1] - 1)
                sampled.append(req)
                for sibling in req.forks:  # n > 1: siblings sample from the same logits
                    rows.append(qsl[-1] - 1)
                    sampled.append(sibling)
        width = max(len(t) for t in block_tables)
        tables = np.zeros((len(block_tables), width), dtype=np.int32)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = t
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=max(s.num_tokens for s in plan.seqs),
            max_seq_len=max(seq_lens),
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(np.concatenate(pos_parts)).to(dev),
            meta=meta,
            logits_rows=torch.tensor(rows, dtype=torch.int64, device=dev),
            sampled=sampled,
        )

    @torch.inference_mode()
    def forward_hidden(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, block_tables: list[list[int]]) -> tuple[list[Request], SamplerOutput | None]:
        """Run one step; returns the requests that got a new token and the sampler's output for them."""
        if plan.ops:
            self.apply(plan.ops)
        if not plan.seqs:
            return [], None
        inputs = self.prepare(plan, block_tables)
        hidden = self.forward_hidden(inputs)
        if not inputs.sampled:
            return [], None
        logits = self.model.compute_logits(hidden[inputs.logits_rows])
        return inputs.sampled, sample(logits, self._sampling_batch(inputs.sampled), self.generator)

    def apply(self, ops: KVOps) -> None:
        """Block movements the KV manager decided, in order: swap-out, swap-in, copy-on-write."""
        b = self.backend
        if ops.swap_out:
            src = torch.tensor([g for g, _ in ops.swap_out], device=self.device)
            dst = torch.tensor([c for _, c in ops.swap_out])
            for gpu, cpu in zip(self.kv_caches, self.cpu_caches):
                cpu[:, dst] = b.gather_blocks(gpu, src).to("cpu")
        if ops.swap_in:
            src = torch.tensor([c for c, _ in ops.swap_in])
            dst = torch.tensor([g for _, g in ops.swap_in], device=self.device)
            for gpu, cpu in zip(self.kv_caches, self.cpu_caches):
                b.scatter_blocks(gpu, cpu[:, src], dst)
        if ops.copies:
            src = torch.tensor([s for s, _ in ops.copies], device=self.device)
            dst = torch.tensor([d for _, d in ops.copies], device=self.device)
            for gpu in self.kv_caches:
                b.copy_blocks(gpu, src, dst)

    def _sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        params = [r.params for r in reqs]
        dev = self.device
        wants = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingBatch(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
            generators=[r.generator for r in reqs],
            all_greedy=all(p.temperature == 0 for p in params),
            needs_truncation=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
            max_top_logprobs=max(wants, default=-1),
        )
