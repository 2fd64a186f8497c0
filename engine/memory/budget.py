"""How many KV blocks the engine gets, decided once at start-up.

A KV pool that is too large for the device fails later, mid-traffic; one that cannot hold a single
max_model_len sequence can never serve some requests.  Both are caught here, before serving, with
a message that gives the numbers and the flags to change.

CPU: `--kv-cache-memory-bytes`, else `--cpu-kv-cache-fraction` of available RAM, capped at what
max_num_seqs sequences of max_model_len could ever use (more would only be zeroed memory).
CUDA: `--kv-cache-memory-bytes`, else what remains of total x gpu_memory_utilization after the
weights and what other processes hold, less a reserve for activations proportional to
max_num_batched_tokens.  (The profiled budget with a measured fragmentation buffer replaces this
estimate in the memory work.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ConfigError, EngineConfig
from engine.kv.kv_cache_manager import blocks_for_tokens

_ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN = 64  # generous: residual, qkv, mlp intermediates, logits slice


@dataclass
class KVPlan:
    num_blocks: int
    bytes_per_block: int
    kv_bytes: int
    source: str

    @property
    def num_tokens(self) -> int:
        return self.num_blocks


def plan_kv_cache(config: EngineConfig, bytes_per_block: int, hidden_size: int, device: torch.device) -> KVPlan:
    assert config.max_model_len is not None and config.max_num_batched_tokens is not None
    useful_blocks = config.max_num_seqs * blocks_for_tokens(config.max_model_len, config.block_size)
    if config.kv_cache_memory_bytes is not None:
        kv_bytes, source = config.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        activations = config.max_num_batched_tokens * hidden_size * _ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN
        kv_bytes = int(total * config.gpu_memory_utilization - (total - free) - activations)
        source = "--gpu-memory-utilization"
    else:
        import psutil

        kv_bytes = int(psutil.virtual_memory().available * config.cpu_kv_cache_fraction)
        kv_bytes = min(kv_bytes, useful_blocks * bytes_per_block)
        source = "--cpu-kv-cache-fraction"
    num_blocks = max(0, kv_bytes // bytes_per_block)
    needed = blocks_for_tokens(config.max_model_len, config.block_size)
    if num_blocks < needed:
        raise ConfigError(
            f"the KV cache ({source}) holds {num_blocks} blocks = {num_blocks * config.block_size} tokens, "
            f"but one sequence of --max-model-len {config.max_model_len} needs {needed} blocks "
            f"({needed * bytes_per_block / 2**20:.1f} MiB at {bytes_per_block} bytes per block of "
            f"{config.block_size} tokens); lower --max-model-len, or give the KV cache more memory "
            "(--kv-cache-memory-bytes, --gpu-memory-utilization), or use a smaller/quantized model"
        )
    return KVPlan(num_blocks=num_blocks, bytes_per_block=bytes_per_block,
                  kv_bytes=num_blocks * bytes_per_block, source=source)
