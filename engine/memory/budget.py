"""How many KV blocks the engine gets, decided once at start-up.

A KV pool that is too large for the device fails later, mid-traffic; one that cannot hold a single
max_model_len sequence can never serve some requests.  Both are caught here, before serving, with
a message that gives the numbers and the flags to change.

CUDA (docs/architecture.md, "Memory"): memory other processes hold is read before our weights load and is
never ours; after loading, one dummy step at max_num_batched_tokens is profiled for peak allocated
and peak reserved memory.  Their difference is what the caching allocator lost to fragmentation in
that step, and the KV budget keeps `max(150 MiB, factor x fragmentation)` in reserve (seed 002):

    kv = total x gpu_memory_utilization - used by others/context - weights - peak activations - buffer
         - CUDA graph pool (measured by capturing the largest decode graph once during profiling)

CPU: `--kv-cache-memory-bytes`, else `--cpu-kv-cache-fraction` of available RAM, capped at what
max_num_seqs sequences of max_model_len could ever use (more would only be zeroed memory).
`--kv-cache-memory-bytes` overrides the computation everywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.config import ConfigError, ResolvedConfig
from engine.kv.kv_cache_manager import blocks_for_tokens

MIN_FRAGMENTATION_BUFFER = 150 * 2**20
ALLOC_CONF_DEFAULT = "expandable_segments:True"


@dataclass
class DeviceBaseline:
    """GPU memory in use before we loaded anything (other processes, the CUDA context)."""

    total_bytes: int
    used_before_bytes: int


@dataclass
class Profile:
    weights_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    activation_bytes: int
    non_torch_bytes: int
    graph_bytes: int = 0  # the CUDA graphs' memory pool (decode graphs, captured after the KV cache)

    @property
    def fragmentation_bytes(self) -> int:
        return max(0, self.peak_reserved_bytes - self.peak_allocated_bytes)

    def cacheable(self) -> dict[str, int]:
        """What another start with the same model, GPU and settings can reuse (engine/runner/probe_cache.py):
        not the weights' bytes or other processes' memory, which are read live."""
        return {
            "activation_bytes": self.activation_bytes,
            "fragmentation_bytes": self.fragmentation_bytes,
            "graph_bytes": self.graph_bytes,
        }

    @classmethod
    def from_cached(cls, values: dict[str, int], weights_bytes: int) -> Profile | None:
        try:
            activation, fragmentation = int(values["activation_bytes"]), int(values["fragmentation_bytes"])
            graph = int(values.get("graph_bytes") or 0)
        except (KeyError, TypeError, ValueError):
            return None
        return cls(
            weights_bytes=weights_bytes,
            peak_allocated_bytes=0,
            peak_reserved_bytes=fragmentation,
            activation_bytes=activation,
            non_torch_bytes=0,  # the baseline, read live, covers other processes and the context
            graph_bytes=graph,
        )


@dataclass
class KVPlan:
    num_blocks: int
    bytes_per_block: int
    kv_bytes: int
    source: str
    block_size: int = 16
    max_model_len: int = 0
    total_bytes: int | None = None
    weights_bytes: int | None = None
    activation_bytes: int | None = None
    non_torch_bytes: int | None = None
    fragmentation_buffer_bytes: int = 0
    graph_bytes: int | None = None
    profile: Profile | None = field(default=None, repr=False)
    # Tensor parallelism: the blocks every rank uses, the smallest rank's plan (None: this plan alone).
    agreed_blocks: int | None = None
    weights_by_dtype: dict[str, int] = field(default_factory=dict)  # storage dtype -> bytes (quantization)
    kv_dtype: str = ""  # the KV cache's storage dtype (float8_e4m3fn with --kv-cache-dtype fp8)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks if self.agreed_blocks is None else self.agreed_blocks

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        per_seq = blocks_for_tokens(self.max_model_len, self.block_size) if self.max_model_len else 1
        return self.num_blocks / per_seq

    def table(self) -> str:
        """The plan as the one-screen table printed at start-up."""
        rows = self.rows()
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)

    def rows(self) -> list[tuple[str, str]]:
        def gib(x: int | None) -> str:
            return "-" if x is None else f"{x / 2**30:8.2f} GiB"

        by_dtype = ", ".join(f"{name} {x / 2**30:.2f}" for name, x in self.weights_by_dtype.items())
        return [
            ("device memory (total)", gib(self.total_bytes)),
            ("weights", gib(self.weights_bytes) + (f"  ({by_dtype} GiB)" if by_dtype else "")),
            ("peak activations", gib(self.activation_bytes)),
            ("CUDA graphs", gib(self.graph_bytes) if self.graph_bytes else "-  (--enforce-eager or CPU)"),
            ("other processes + CUDA context", gib(self.non_torch_bytes)),
            ("fragmentation buffer", gib(self.fragmentation_buffer_bytes or None)),
            ("KV cache", gib(self.kv_bytes) + f"  ({self.source})"),
            (
                "KV cache dtype",
                f"{self.kv_dtype or '-'}, {self.bytes_per_block // max(1, self.block_size)} bytes/token",
            ),
            ("KV blocks x block size", f"{self.num_blocks} x {self.block_size}"),
            ("KV tokens", f"{self.num_tokens}"),
            ("max concurrency at max_model_len", f"{self.max_concurrency:.1f} x {self.max_model_len} tokens"),
        ]


def ranks_table(plans: list[KVPlan]) -> str:
    """Every tensor-parallel rank's plan side by side, and the block count they agreed on (the smallest)."""
    if len(plans) == 1:
        return plans[0].table()
    columns = [p.rows() for p in plans]
    names = [name for name, _ in columns[0]]
    values = [[v.strip() for _, v in col] for col in columns]
    header = ["", *(f"rank {r}" for r in range(len(plans)))]
    body = [[name, *(col[i] for col in values)] for i, name in enumerate(names)]
    agreed = min(p.num_blocks for p in plans)
    body.append(["KV blocks every rank uses", *(str(agreed) for _ in plans)])
    widths = [max(len(row[c]) for row in [header, *body]) for c in range(len(header))]
    return "\n".join(
        "  " + "  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)).rstrip() for row in [header, *body]
    )


def set_allocator_defaults() -> None:
    """expandable_segments unless the user chose allocator settings: segments grow in place instead
    of leaving stranded free blocks, which is what turns fragmentation into OOM after days."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF_DEFAULT
    if torch.cuda.is_initialized():  # too late for the environment: tell the live allocator
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.10
        (setter or torch.cuda.memory._set_allocator_settings)(ALLOC_CONF_DEFAULT)


def device_baseline(device: torch.device, kept_bytes: int = 0) -> DeviceBaseline:
    """`kept_bytes`: this engine's weights held by another process (the keeper, engine/keeper/): they are
    counted as weights, not as other processes' memory."""
    free, total = torch.cuda.mem_get_info(device)
    return DeviceBaseline(total_bytes=total, used_before_bytes=max(0, total - free - kept_bytes))


def profile_graph_memory(device: torch.device, capture: Callable[[], None]) -> int:
    """Reserved memory that `capture` (allocating its inputs, then capturing graphs) keeps."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    capture()
    torch.cuda.synchronize(device)
    used = torch.cuda.memory_reserved(device) - before
    torch.cuda.empty_cache()
    return max(0, used)


def profile_step(
    device: torch.device, weights_bytes: int, run_dummy_step: Callable[[], None], kept_bytes: int = 0
) -> Profile:
    """Peak memory of one step at the largest batch the scheduler can build (`kept_bytes`: see device_baseline)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_dummy_step()
    torch.cuda.synchronize(device)
    peak_alloc = torch.cuda.max_memory_allocated(device)
    peak_reserved = torch.cuda.max_memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    torch_reserved = torch.cuda.memory_reserved(device)
    return Profile(
        weights_bytes=weights_bytes,
        peak_allocated_bytes=peak_alloc,
        peak_reserved_bytes=peak_reserved,
        activation_bytes=max(0, peak_alloc - before),
        non_torch_bytes=max(0, (total - free) - torch_reserved - kept_bytes),
    )


def plan_kv_cache(
    config: ResolvedConfig,
    bytes_per_block: int,
    device: torch.device,
    baseline: DeviceBaseline | None = None,
    profile: Profile | None = None,
    kv_dtype: str = "",
    weights_by_dtype: dict[str, int] | None = None,
) -> KVPlan:
    plan = KVPlan(
        num_blocks=0,
        bytes_per_block=bytes_per_block,
        kv_bytes=0,
        source="",
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        kv_dtype=kv_dtype,
        weights_by_dtype=dict(weights_by_dtype or {}),
    )
    if device.type == "cuda" and baseline is not None and profile is not None:
        buffer = max(MIN_FRAGMENTATION_BUFFER, int(config.fragmentation_buffer_factor * profile.fragmentation_bytes))
        plan.total_bytes = baseline.total_bytes
        plan.weights_bytes = profile.weights_bytes
        plan.activation_bytes = profile.activation_bytes
        plan.non_torch_bytes = max(profile.non_torch_bytes, baseline.used_before_bytes)
        plan.fragmentation_buffer_bytes = buffer
        plan.graph_bytes = profile.graph_bytes
        plan.profile = profile
    if config.kv_cache_memory_bytes is not None:
        kv_bytes, plan.source = config.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
    elif plan.total_bytes is not None:
        kv_bytes = int(
            plan.total_bytes * config.gpu_memory_utilization
            - plan.non_torch_bytes
            - plan.weights_bytes
            - plan.activation_bytes
            - plan.fragmentation_buffer_bytes
            - (plan.graph_bytes or 0)
        )
        plan.source = f"--gpu-memory-utilization {config.gpu_memory_utilization}"
    else:
        import psutil

        useful_blocks = config.max_num_seqs * blocks_for_tokens(config.max_model_len, config.block_size)
        # Tensor-parallel CPU ranks share one machine's RAM: each takes its share of the fraction.
        ram = psutil.virtual_memory().available * config.cpu_kv_cache_fraction / config.tensor_parallel_size
        kv_bytes = int(ram)
        kv_bytes = min(kv_bytes, useful_blocks * bytes_per_block)
        plan.source = f"--cpu-kv-cache-fraction {config.cpu_kv_cache_fraction} of free RAM"
    plan.num_blocks = max(0, kv_bytes // bytes_per_block)
    plan.kv_bytes = plan.num_blocks * bytes_per_block
    needed = blocks_for_tokens(config.max_model_len, config.block_size)
    if plan.num_blocks < needed:
        raise ConfigError(
            f"the KV cache ({plan.source}) holds {plan.num_blocks} blocks = {plan.num_tokens} tokens, but one "
            f"sequence of --max-model-len {config.max_model_len} needs {needed} blocks "
            f"({needed * bytes_per_block / 2**20:.1f} MiB at {bytes_per_block} bytes per block of "
            f"{config.block_size} tokens).\n{plan.table()}\n"
            "Change: lower --max-model-len, or give the KV cache more memory (--gpu-memory-utilization, "
            "--kv-cache-memory-bytes), or use a smaller or quantized model"
        )
    return plan
