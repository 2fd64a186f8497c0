"""A tensor-parallel sum read straight from the other GPUs' memory, for the small all-reduces of decode steps.

A decode step of the 70B shape at TP=4 does 160 all-reduces of a few MiB each; NCCL's ring takes about 43 us
for 4 MiB on four NVLinked H100/H200s, a third of the step (issue 36, docs/decisions/peer-allreduce.md).  Here
every rank keeps one buffer in torch's symmetric memory (`torch.distributed._symmetric_memory`: the same
allocation mapped into every rank's address space over NVLink/P2P) and runs torch's two-shot kernel on it:
each rank sums its quarter of the rows from all buffers and writes the sum into every buffer, between two
barriers on the GPUs.  No NVLink multicast (which stays off on the devices we use), no host round trip, and it
can be captured into a CUDA graph.

PAGEKEEPER_TP_ALLREDUCE chooses: `auto` (default) uses it on CUDA where it sets up and falls back to NCCL with
one warning; `nccl` never uses it; `require` makes a failed set-up an error.  Sums larger than the buffer, and
the overlapped micro-batches' (engine/model/overlap.py: they need NCCL's asynchronous handle), stay on NCCL.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from engine.config import ConfigError

MODES = ("auto", "nccl", "require")
# The buffer, and so the largest sum that takes this path: a step of up to 1,024 rows of the 70B shape's 8,192
# bf16 columns (the piecewise and decode graphs' sizes); larger steps are eager, compute-bound prefills.
MAX_BYTES = 16 << 20
# Once a process has set up symmetric memory for a group, it does not again: after a first group's set-up (an
# engine at TP=2, or a sub-group), a second one in the same process (an engine at TP=4 made after it, or the
# world group) hung in the device runs.  An engine process has one group; a process that makes several engines
# (the offline API, tests, benchmarks) sums the later ones' through NCCL, and says so.
_SET_UP_IN_PROCESS = False
SUMMED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what torch's two-shot kernel is built for


def checked_mode(device: torch.device) -> str:
    """The mode for ranks on `device`, checked before any rank starts: `require` on the CPU is a ConfigError."""
    mode = mode_from_env()
    if mode == "require" and device.type != "cuda":
        raise ConfigError(
            "PAGEKEEPER_TP_ALLREDUCE=require needs CUDA GPUs (the CPU's ranks sum through gloo); unset it or use auto"
        )
    return mode


def mode_from_env() -> str:
    """PAGEKEEPER_TP_ALLREDUCE, checked: a ConfigError (exit 2) naming the variable for anything but MODES."""
    value = os.environ.get("PAGEKEEPER_TP_ALLREDUCE", "auto")
    if value not in MODES:
        raise ConfigError(f"PAGEKEEPER_TP_ALLREDUCE={value!r}: expected one of {', '.join(MODES)}")
    return value


class PeerAllReduce:
    """One rank's symmetric buffer and the group it was set up with; `sum_` sums a tensor over the ranks."""

    def __init__(self, buffer: torch.Tensor, group_name: str, max_bytes: int) -> None:
        self.buffer = buffer  # uint8, max_bytes, symmetric across the group
        self.group_name = group_name
        self.max_bytes = max_bytes

    @classmethod
    def set_up(cls, group: Any, device: torch.device, max_bytes: int = MAX_BYTES) -> PeerAllReduce:
        """Allocate and exchange the buffers: a collective, every rank of `group` calls it at the same point.
        Raises whatever torch raises where symmetric memory or its two-shot kernel is missing."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        group = group if group is not None else dist.group.WORLD
        name = group.group_name
        if not hasattr(torch.ops.symm_mem, "two_shot_all_reduce_"):
            raise RuntimeError("this torch has no symm_mem.two_shot_all_reduce_")
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # deprecated (and a no-op) from torch 2.8 on
                enable(name)  # needed by torch 2.6-2.7
        buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buffer, name)
        return cls(buffer, name, max_bytes)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether this path sums `x`: a dtype torch's kernel sums (not the float64 timings the ranks agree on at
        start-up), on the buffer's device, contiguous, and small enough."""
        return (
            x.dtype in SUMMED_DTYPES
            and x.device == self.buffer.device
            and x.is_contiguous()
            and x.numel() * x.element_size() <= self.max_bytes
        )

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the ranks, in place (as NCCL's all_reduce): copied into the buffer, summed there by
        torch's two-shot kernel, copied back."""
        staged = self.buffer[: x.numel() * x.element_size()].view(x.dtype)
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
        x.view(-1).copy_(staged)
        return x

    def check(self, group: Any, device: torch.device) -> None:
        """One sum of known values at set-up: every rank adds rank + 1 in float32, so a wrong mapping or a kernel
        that does not run is an error at start-up, not wrong tokens."""
        import torch.distributed as dist

        size, rank = dist.get_world_size(group), dist.get_rank(group)
        x = torch.full((4097,), float(rank + 1), dtype=torch.float32, device=device)
        self.sum_(x)
        expected = size * (size + 1) / 2
        if not bool(torch.all(x == expected)):
            raise RuntimeError(f"symmetric-memory all-reduce summed to {x[0].item()}, expected {expected}")


def set_up_for(group: Any, device: torch.device, mode: str) -> tuple[PeerAllReduce | None, str | None]:
    """The peer path for a CUDA group in `mode`, or (None, why not); `require` raises instead of falling back.
    The ranks agree through NCCL before they start torch's rendezvous and before the first sum on the buffers, so
    that a rank that cannot (one whose process set up symmetric memory before, or whose set-up failed) never leaves
    the others waiting in a collective or in the kernel's barrier: all use the path or none does."""
    if mode == "nccl" or device.type != "cuda":
        return None, None
    global _SET_UP_IN_PROCESS
    why: str | None = None
    if not _all_ranks(not _SET_UP_IN_PROCESS, group, device):  # before any rank starts torch's rendezvous
        why = (
            "symmetric memory was already set up once in this process (a second set-up, for a later engine or "
            "group of the same process, hung on 4 H200s): NCCL sums for this engine"
        )
        if mode == "require":
            raise RuntimeError(f"PAGEKEEPER_TP_ALLREDUCE=require: {why}")
        return None, why
    _SET_UP_IN_PROCESS = True
    peer: PeerAllReduce | None = None
    try:
        peer = PeerAllReduce.set_up(group, device)
    except Exception as e:  # noqa: BLE001 - any failure of an optional fast path falls back, named
        why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    if not _all_ranks(peer is not None, group, device) and peer is not None:
        peer, why = None, "another rank's symmetric memory did not set up"
    if peer is not None:
        try:
            peer.check(group, device)
        except Exception as e:  # noqa: BLE001 - a failed check falls back like a failed set-up
            peer, why = None, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
        if not _all_ranks(peer is not None, group, device) and peer is not None:
            peer, why = None, "another rank's check of the symmetric-memory sum failed"
    if peer is None and mode == "require":
        raise RuntimeError(f"PAGEKEEPER_TP_ALLREDUCE=require: symmetric memory did not set up: {why}")
    return peer, why


def _all_ranks(ok: bool, group: Any, device: torch.device) -> bool:
    """Whether `ok` holds on every rank of the group (an NCCL all-reduce of one flag)."""
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def set_up_in_process() -> bool:
    """Whether this process has set up symmetric memory (later groups of the process sum through NCCL)."""
    return _SET_UP_IN_PROCESS
