"""The KV cache of every layer as one allocation, made outside the allocator's expandable segments.

The engine runs torch's allocator with expandable segments (engine/memory/budget.py says why: fragmentation over
days).  Such a segment maps physical memory in 20 MiB pieces, so a 100 GiB KV cache was thousands of map calls
when it was allocated and as many unmaps when a leaving engine freed it, and a restart's successor allocating
while the old processes unmapped (and tore down) made the driver serialise both: a TP=4 restart's new KV cache
took 4.5 s instead of 1.2 s (docs/decisions/kv-one-allocation.md).  The KV cache is allocated once and lives as
long as the engine, so fragmentation is no reason to map it in pieces: it is one plain allocation (one map, one
unmap), and each layer's cache is a view of it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_EXPANDABLE = "expandable_segments"


def expandable_segments_on() -> bool:
    """Whether the allocator's settings (the environment torch read them from) turn expandable segments on."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == _EXPANDABLE:
            return value.strip().lower() == "true"
    return False


def _set_expandable(on: bool) -> None:
    setting = f"{_EXPANDABLE}:{'True' if on else 'False'}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.10
    (setter or torch.cuda.memory._set_allocator_settings)(setting)


@contextmanager
def plain_segments(device: torch.device) -> Iterator[None]:
    """Allocations made inside are plain cudaMalloc segments even where the engine expands its segments."""
    toggle = device.type == "cuda" and expandable_segments_on()
    if toggle:
        _set_expandable(False)
    try:
        yield
    finally:
        if toggle:
            _set_expandable(True)


def allocate_kv_caches(
    layer_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, num_layers: int
) -> list[torch.Tensor]:
    """`num_layers` zeroed caches of `layer_shape`, contiguous views of one allocation (freed when the last view
    goes: engine/runner/release.py)."""
    per_layer = math.prod(layer_shape)
    with plain_segments(device):
        whole = torch.zeros((num_layers, per_layer), dtype=dtype, device=device)
    return [whole[i].view(layer_shape) for i in range(num_layers)]
