"""The memory plan for a checkpoint, computed from its files alone (no weights loaded, no GPU used).

`opsctl doctor` shows it before anything starts: how big the weights are, what one token of KV
costs, and how many tokens and max-length sequences the KV cache would hold on this device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig
from engine.kv.kv_cache_manager import blocks_for_tokens
from engine.model.weights import iter_checkpoint

_DTYPE_BYTES = {
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F64": 8,
    "I64": 8,
    "I32": 4,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


@dataclass
class MemoryEstimate:
    architecture: str
    dtype: str
    max_model_len: int
    block_size: int
    weight_bytes: int  # as loaded, in the engine's dtype
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    kv_budget_bytes: int | None  # None when it depends on a GPU that is not here
    kv_budget_source: str

    @property
    def kv_tokens(self) -> int | None:
        if self.kv_budget_bytes is None:
            return None
        return (self.kv_budget_bytes // self.kv_bytes_per_block) * self.block_size

    @property
    def max_concurrency(self) -> float | None:
        tokens = self.kv_tokens
        if tokens is None:
            return None
        return tokens / (blocks_for_tokens(self.max_model_len, self.block_size) * self.block_size)


def checkpoint_parameters(model_dir: Path) -> int:
    """Number of parameters, from the safetensors headers only."""
    total = 0
    for _name, tensor in iter_checkpoint(model_dir, meta=True):  # a broken file is a ModelLoadError naming it
        total += math.prod(tensor.shape)
    return total


def estimate(config: EngineConfig, gpu_total_bytes: int | None = None, gpu_used_bytes: int = 0) -> MemoryEstimate:
    import torch

    from engine.model.loader import inspect_model

    info = inspect_model(config)
    config.resolve_limits(info.max_position_embeddings, info.sliding_window)
    cfg = info.hf_config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    elem = torch.empty((), dtype=info.dtype).element_size()
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem
    weights = checkpoint_parameters(info.path) * elem
    assert config.max_model_len is not None
    budget: int | None
    if config.kv_cache_memory_bytes is not None:
        budget, source = config.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
    elif gpu_total_bytes is not None:
        budget = int(gpu_total_bytes * config.gpu_memory_utilization) - gpu_used_bytes - weights
        source = "--gpu-memory-utilization (before activations and the fragmentation buffer)"
    elif config.resolved_device() == "cpu":
        import psutil

        useful = config.max_num_seqs * blocks_for_tokens(config.max_model_len, config.block_size)
        budget = min(
            int(psutil.virtual_memory().available * config.cpu_kv_cache_fraction),
            useful * per_token * config.block_size,
        )
        source = "--cpu-kv-cache-fraction of available RAM"
    else:
        budget, source = None, "profiled at start-up on the GPU (no NVML reading here)"
    return MemoryEstimate(
        architecture=info.architecture,
        dtype=str(info.dtype).removeprefix("torch."),
        max_model_len=config.max_model_len,
        block_size=config.block_size,
        weight_bytes=weights,
        kv_bytes_per_token=per_token,
        kv_bytes_per_block=per_token * config.block_size,
        kv_budget_bytes=max(0, budget) if budget is not None else None,
        kv_budget_source=source,
    )
