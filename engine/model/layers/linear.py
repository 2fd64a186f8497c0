"""A linear layer that holds several checkpoint matrices stacked along its output dimension.

Fusing q/k/v (and gate/up) into one matmul is a large win on the GPU; the checkpoint still stores
them separately, so each shard remembers where its rows live and the loader copies into them.
Stacking along the output dimension is also what column-parallel sharding needs later.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size

    def shard(self, param: torch.Tensor, shard_id: str) -> torch.Tensor:
        start, size = self.shard_offsets[shard_id]
        return param.data.narrow(0, start, size)
