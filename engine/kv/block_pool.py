"""The fixed pool of KV blocks: which are free, and how many owners each used block has.

Block ids index the preallocated per-layer KV tensors directly, so this pool is the single source
of truth for KV memory: a block is either on the free list or has a reference count >= 1, never
both.  Reference counts exist so that several sequences can share a block (prefix sharing,
copy-on-write for n > 1) and the block is returned only when the last owner lets go.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised when a caller asks for more blocks than are free; callers check `num_free` first."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by live sequences (what vllm_gpu_cache_usage_perc reports)."""
        return self.num_used / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, each with reference count 1; all or nothing."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Add an owner to blocks that are already in use."""
        for b in block_ids:
            if self._ref_counts[b] < 1:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._ref_counts[b] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one owner from each block; a block whose last owner left goes back on the free list."""
        for b in block_ids:
            count = self._ref_counts[b]
            if count < 1:
                raise ValueError(f"block {b} released more times than it was allocated")
            self._ref_counts[b] = count - 1
            if count == 1:
                self._free.append(b)
