"""The tensor-parallel group a model's layers talk through: this rank, how many, and two collectives.

Layers hold a TPGroup instead of reading a process-wide global, so a model built for one rank
says so in its constructor, and a single-GPU model (`SINGLE`) never touches torch.distributed:
with size 1 every collective is the identity and costs nothing.

`start_all_reduce` is the same sum started without waiting for it (`Reduction.wait` finishes it):
a step split into two micro-batches (engine/model/overlap.py) sums one micro-batch's partial
outputs while the other's matrix products run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.parallel.peer_allreduce import PeerAllReduce


@dataclass
class Reduction:
    """An all-reduce in flight over `tensor` (in place); `wait` returns the sum.  On CUDA waiting orders the
    current stream after the collective's (the host does not block); on the CPU (gloo) the host waits."""

    tensor: torch.Tensor
    work: Any = None  # the collective's handle (None: nothing to wait for)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.tensor


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group (None: the default group)
    # --tensor-parallel-overlap-tokens: steps of at least this many tokens run as two micro-batches whose
    # all-reduces overlap each other's matrix products (0: never); the model keeps its own copy, which a
    # benchmark may change between steps (engine/distributed/executor.py, set_overlap_tokens)
    overlap_tokens: int = 0
    # the symmetric-memory sum for tensors that fit its buffer (engine/parallel/peer_allreduce.py; None: NCCL's)
    peer: PeerAllReduce | None = field(default=None, compare=False, repr=False)

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (row-parallel outputs, the vocab-parallel embedding)."""
        if self.size == 1:
            return x
        if self.peer is not None and self.peer.fits(x):
            return self.peer.sum_(x)
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def start_all_reduce(self, x: torch.Tensor) -> Reduction:
        """Start summing `x` over the ranks, in place; `x` must not be read or written before `wait()`."""
        if self.size == 1:
            return Reduction(x)
        import torch.distributed as dist

        return Reduction(x, dist.all_reduce(x, group=self.group, async_op=True))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order (vocab-parallel logits)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        if x.is_cuda:
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            return torch.cat(out.unbind(0), dim=-1)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()


@dataclass(frozen=True)
class Part:
    """This rank's share of one dimension of a checkpoint tensor: rows [start, start + size) of `full`."""

    full: int
    start: int
    size: int

    @classmethod
    def whole(cls, n: int) -> Part:
        return cls(n, 0, n)

    @classmethod
    def even(cls, n: int, tp: TPGroup, what: str) -> Part:
        """An even split; `what` names the dimension in the error when it does not divide."""
        if n % tp.size:
            raise ValueError(
                f"--tensor-parallel-size {tp.size} does not divide the model's {what} ({n}); "
                f"use a size that divides {n}"
            )
        size = n // tp.size
        return cls(n, tp.rank * size, size)

    @classmethod
    def padded(cls, n: int, tp: TPGroup) -> Part:
        """ceil(n / size) rows per rank, the last rank's tail past `n` being padding (the vocabulary)."""
        size = -(-n // tp.size)
        return cls(n, tp.rank * size, size)

    @property
    def real(self) -> int:
        """Rows of this share that exist in the checkpoint (fewer than `size` only in padding)."""
        return max(0, min(self.size, self.full - self.start))


@dataclass(frozen=True)
class HeadSplit:
    """Attention heads on this rank: query heads split evenly; KV heads split evenly when there are
    at least as many as ranks, else each rank holds the one KV head its query heads read
    (replicated over size / num_kv_heads ranks)."""

    num_heads: int  # on this rank
    num_kv_heads: int  # on this rank
    q: Part  # in heads
    kv: Part  # in heads

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, tp: TPGroup) -> HeadSplit:
        n = tp.size
        if num_heads % n:
            raise ValueError(
                f"--tensor-parallel-size {n} does not divide the model's {num_heads} attention heads; "
                f"use one of {_divisors(num_heads)}"
            )
        q = Part.even(num_heads, tp, "attention heads")
        if num_kv_heads >= n:
            kv = Part.even(num_kv_heads, tp, "key/value heads")
        elif n % num_kv_heads:
            raise ValueError(
                f"--tensor-parallel-size {n} is neither a divisor nor a multiple of the model's {num_kv_heads} "
                f"key/value heads; use one of {_divisors(num_heads)} that is"
            )
        else:
            kv = Part(num_kv_heads, tp.rank // (n // num_kv_heads), 1)
        return cls(q.size, kv.size, q, kv)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
