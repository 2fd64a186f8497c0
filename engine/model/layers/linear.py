"""Linear layers that know their share of a checkpoint matrix (Megatron-style tensor parallelism).

`MergedLinear` stacks several checkpoint matrices along its output dimension (q/k/v, gate/up):
one matmul instead of three is a large win on the GPU, and stacking along the output is exactly
column parallelism, so each part also remembers which rows of its checkpoint matrix this rank
holds.  `RowLinear` holds a slice of the input dimension and sums the ranks' partial outputs with
one all-reduce.  With one rank both are plain nn.Linear layers with the same numerics.

The loader asks a layer `checkpoint_slice(leaf, shard)` and reads only that slice from the
safetensors file, so no rank ever holds a full copy of a sharded matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.group import SINGLE, Part, TPGroup


@dataclass(frozen=True)
class CheckpointSlice:
    """Where a parameter's data sits in the checkpoint tensor: `size` entries from `start` along `dim`
    (whose full length must be `full`), copied to rows [dest, dest + size) of the parameter."""

    dim: int
    start: int
    size: int
    full: int
    dest: int = 0


class MergedLinear(nn.Linear):
    """Column-parallel linear over named parts; a part given as an int is held whole."""

    def __init__(self, in_features: int, parts: dict[str, int | Part], bias: bool) -> None:
        resolved = {k: Part.whole(v) if isinstance(v, int) else v for k, v in parts.items()}
        super().__init__(in_features, sum(p.size for p in resolved.values()), bias=bias)
        self.parts = resolved
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, part in resolved.items():
            self.shard_offsets[name] = (start, part.size)
            start += part.size

    def checkpoint_slice(self, leaf: str, shard_id: str | None) -> CheckpointSlice:
        part = self.parts[shard_id or ""]
        return CheckpointSlice(0, part.start, part.size, part.full, self.shard_offsets[shard_id or ""][0])


class ColumnLinear(MergedLinear):
    """One checkpoint matrix, split by output rows (OPT's fc1)."""

    def __init__(self, in_features: int, part: Part, bias: bool) -> None:
        super().__init__(in_features, {"": part}, bias)


class RowLinear(nn.Linear):
    """Input dimension split over the ranks; the partial outputs are summed, then the bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE) -> None:
        self.part = Part.even(in_features, tp, "input features of a row-parallel layer")
        super().__init__(self.part.size, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.linear(x, self.weight, self.bias)
        return self.finish(self.tp.all_reduce(self.partial(x)))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the product, before the sum over the ranks and without the bias."""
        return F.linear(x, self.weight)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The summed product plus the bias (added once, after the sum)."""
        return y if self.bias is None else y + self.bias

    def checkpoint_slice(self, leaf: str, shard_id: str | None) -> CheckpointSlice | None:
        if leaf != "weight":
            return None  # the bias is replicated
        return CheckpointSlice(1, self.part.start, self.part.size, self.part.full)


class VocabEmbedding(nn.Module):
    """The token embedding split by vocabulary rows: each rank looks up the ids it holds, zeros for the
    rest, and one all-reduce assembles the rows.  Also the LM head's weight (tied or not): logits are
    computed per shard and gathered, the padding columns past the vocabulary cut off."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.part = Part.padded(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.part.size, dim))
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.embedding(ids, self.weight)
        return self.tp.all_reduce(self.partial(ids))

    def partial(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` this rank holds, zeros for the others (the sum over the ranks is the lookup)."""
        local = ids - self.part.start
        mine = (local >= 0) & (local < self.part.size)
        return F.embedding(local.clamp(0, self.part.size - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = hidden @ self.weight.t()
        if not self.tp.is_parallel:
            return local
        return self.tp.all_gather_last(local)[..., : self.vocab_size]

    def checkpoint_slice(self, leaf: str, shard_id: str | None) -> CheckpointSlice:
        return CheckpointSlice(0, self.part.start, self.part.real, self.part.full)

    @torch.no_grad()
    def finish_load(self) -> None:
        """Zero the padding rows past the vocabulary (the last rank's tail): they must add nothing."""
        if self.part.real < self.part.size:
            self.weight[self.part.real :].zero_()
