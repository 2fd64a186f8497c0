"""The memory plan for a checkpoint, computed from its files alone (no weights loaded, no GPU used).

`opsctl doctor` shows it before anything starts: how big the weights are, what one token of KV
costs, and how many tokens and max-length sequences the KV cache would hold on this device.  With
tensor parallelism every rank gets its own figures (its shard of the weights, its KV heads, its
GPU's free memory), from the model built on the meta device exactly as that rank will build it.

Quantization shows what it buys: the weights per storage dtype (AWQ's packed int32, FP8, the 16-bit
embeddings and norms) beside what the unquantized model would take, and the KV bytes per token in
the cache's dtype beside the other choice of --kv-cache-dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv.kv_cache_manager import blocks_for_tokens
from engine.model.loader import ModelInfo

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
class RankEstimate:
    rank: int
    weight_bytes: int  # this rank's shard, as loaded
    kv_bytes_per_token: int  # its KV heads
    kv_budget_bytes: int | None
    weight_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    unquantized_weight_bytes: int = 0  # the same shard without --quantization (in the model's dtype)


@dataclass
class MemoryEstimate:
    """Rank 0's figures (the only rank without tensor parallelism) and every rank's in `ranks`."""

    architecture: str
    dtype: str
    max_model_len: int
    block_size: int
    weight_bytes: int  # as loaded, in the engine's dtype
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    kv_budget_bytes: int | None  # None when it depends on a GPU that is not here
    kv_budget_source: str
    ranks: list[RankEstimate]
    kv_dtype: str = ""  # the cache's storage dtype
    kv_bytes_per_token_other: int = 0  # with the other --kv-cache-dtype (fp8 <-> the model's dtype)
    quantization: str = ""  # what --quantization / the checkpoint loads, described

    def rank_kv_tokens(self, r: RankEstimate) -> int | None:
        if r.kv_budget_bytes is None:
            return None
        return (r.kv_budget_bytes // (r.kv_bytes_per_token * self.block_size)) * self.block_size

    @property
    def usable_kv_tokens(self) -> int | None:
        """What the engine can use: every rank holds the same blocks, so the smallest rank decides."""
        tokens = [self.rank_kv_tokens(r) for r in self.ranks]
        return None if any(t is None for t in tokens) else min(t for t in tokens if t is not None)

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


@dataclass
class RankShape:
    weights_by_dtype: dict[str, int]
    unquantized_weights: int
    kv_elements_per_token: int  # K and V over every layer, this rank's KV heads

    @property
    def weights(self) -> int:
        return sum(self.weights_by_dtype.values())


def rank_shapes(config: EngineConfig, info: ModelInfo) -> list[RankShape]:
    """Every tensor-parallel rank's weights (per storage dtype, and without quantization) and KV elements
    per token, from the model built on the meta device as that rank builds it (ConfigError when the
    heads, or a quantized layer's packing, do not split)."""
    import dataclasses

    import torch

    from engine.model.loader import build_on_meta
    from engine.parallel.group import TPGroup

    elem = torch.empty((), dtype=info.dtype).element_size()
    plain = dataclasses.replace(info, quant=None)
    out = []
    n = config.tensor_parallel_size
    for rank in range(n):
        model = build_on_meta(info, 1, torch.device("cpu"), TPGroup(rank, n))
        by_dtype: dict[str, int] = {}
        for p in model.parameters():
            name = str(p.dtype).removeprefix("torch.")
            by_dtype[name] = by_dtype.get(name, 0) + p.numel() * p.element_size()
        unquantized = by_dtype.get(str(info.dtype).removeprefix("torch."), 0)
        if info.quant is not None:
            unquantized = sum(
                p.numel() for p in build_on_meta(plain, 1, torch.device("cpu"), TPGroup(rank, n)).parameters()
            )
            unquantized *= elem
        else:
            unquantized = sum(by_dtype.values())
        kv = 2 * model.num_layers * model.num_kv_heads * model.head_dim
        out.append(RankShape(dict(sorted(by_dtype.items(), key=lambda kv_: -kv_[1])), unquantized, kv))
    return out


def estimate(config: EngineConfig, gpus: list[tuple[int, int]] | None = None) -> MemoryEstimate:
    """`gpus`: (total, used) bytes of each rank's GPU (rank r on the r-th), empty without NVML."""
    import torch

    from engine.model.loader import inspect_model

    info = inspect_model(config)
    limits = config.resolve(
        info.max_position_embeddings, info.sliding_window, model_dtype=str(info.dtype).removeprefix("torch.")
    )
    gpus = gpus or []
    ranks = []
    source = ""
    model_elem = torch.empty((), dtype=info.dtype).element_size()
    kv_elem = torch.empty((), dtype=getattr(torch, limits.kv_dtype)).element_size()
    other_elem = model_elem if kv_elem != model_elem else 1  # the other --kv-cache-dtype's
    shapes = rank_shapes(config, info)
    for rank, shape in enumerate(shapes):
        weights, per_token = shape.weights, shape.kv_elements_per_token * kv_elem
        budget: int | None
        if config.kv_cache_memory_bytes is not None:
            budget, source = config.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
        elif rank < len(gpus):
            total, used = gpus[rank]
            budget = int(total * config.gpu_memory_utilization) - used - weights
            source = "--gpu-memory-utilization (before activations and the fragmentation buffer)"
        elif config.resolved_device() == "cpu":
            import psutil

            useful = limits.max_num_seqs * blocks_for_tokens(limits.max_model_len, config.block_size)
            budget = min(
                int(psutil.virtual_memory().available * config.cpu_kv_cache_fraction / config.tensor_parallel_size),
                useful * per_token * config.block_size,
            )
            source = "--cpu-kv-cache-fraction of available RAM"
        else:
            budget, source = None, "profiled at start-up on the GPU (no NVML reading here)"
        ranks.append(
            RankEstimate(
                rank,
                weights,
                per_token,
                None if budget is None else max(0, budget),
                shape.weights_by_dtype,
                shape.unquantized_weights,
            )
        )
    first = ranks[0]
    return MemoryEstimate(
        architecture=info.architecture,
        dtype=str(info.dtype).removeprefix("torch."),
        max_model_len=limits.max_model_len,
        block_size=config.block_size,
        weight_bytes=first.weight_bytes,
        kv_bytes_per_token=first.kv_bytes_per_token,
        kv_bytes_per_block=first.kv_bytes_per_token * config.block_size,
        kv_budget_bytes=first.kv_budget_bytes,
        kv_budget_source=source,
        ranks=ranks,
        kv_dtype=limits.kv_dtype,
        kv_bytes_per_token_other=shapes[0].kv_elements_per_token * other_elem,
        quantization=info.quant.describe() if info.quant is not None else "",
    )
