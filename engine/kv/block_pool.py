"""The fixed pool of KV blocks: which are free, how many owners each used block has, and which
hold a cached prompt prefix.

Block ids index the preallocated per-layer KV tensors directly, so this pool is the single source
of truth for KV memory.  Reference counts let several sequences share a block (prefix sharing,
copy-on-write for n > 1); a block is returned only when its last owner lets go.

Prefix caching never costs capacity: a full block is identified by a digest of its tokens chained
with its parent block's digest (so equal keys mean equal prefixes), and when its last owner lets
go it stays in the cache but counts as free.  Allocation takes never-cached blocks first and then
evicts cached ones, least recently used first, so the cache only ever holds memory nobody else asked for.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

BlockKey = bytes  # 16-byte BLAKE2b digest of (parent digest, tokens): 2**-128 collision odds


class NoFreeBlocksError(RuntimeError):
    """Raised when a caller asks for more blocks than are free; callers check `num_free` first."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # never cached (or evicted)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, no owner; LRU first
        self._ref_counts = [0] * num_blocks
        # Both maps hold only blocks that are cached right now, so they are bounded by num_blocks.
        self._key_of: dict[int, BlockKey] = {}  # cached block -> its key
        self._block_of: dict[BlockKey, int] = {}  # key -> cached block
        self.evictions = 0

    # -- counts -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation can get: never-cached ones plus cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix, held or not (vllm:prefix_cache_blocks_used)."""
        return len(self._key_of)

    def usage(self) -> float:
        """Fraction of blocks held by live sequences (what vllm:kv_cache_usage_perc reports)."""
        return self.num_used / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, each with reference count 1; all or nothing."""
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._uncache(b)
                self.evictions += 1
            self._ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Add an owner to blocks that are already in use."""
        for b in block_ids:
            if self._ref_counts[b] < 1:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._ref_counts[b] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one owner from each block; a block whose last owner left becomes free (cached ones
        become evictable, most recently used last)."""
        for b in block_ids:
            count = self._ref_counts[b]
            if count < 1:
                raise ValueError(f"block {b} released more times than it was allocated")
            self._ref_counts[b] = count - 1
            if count == 1:
                if b in self._key_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # -- the prefix cache ---------------------------------------------------------------------

    @staticmethod
    def key(parent: BlockKey | None, tokens: list[int]) -> BlockKey:
        """The key of a full block: its tokens chained with everything before them."""
        h = hashlib.blake2b(parent or b"", digest_size=16)
        h.update(array("q", tokens).tobytes())
        return h.digest()

    def peek(self, key: BlockKey) -> int | None:
        """The cached block for `key`, without taking an owner on it."""
        return self._block_of.get(key)

    def lookup(self, key: BlockKey) -> int | None:
        """The cached block for `key`, taking an owner on it (out of the evictable list), or None."""
        b = self._block_of.get(key)
        if b is None:
            return None
        if self._ref_counts[b] == 0:
            del self._evictable[b]
        self._ref_counts[b] += 1
        return b

    def cache(self, block_id: int, key: BlockKey) -> None:
        """Register a block that was just filled; a key already cached elsewhere keeps that block."""
        if key in self._block_of or block_id in self._key_of:
            return
        self._key_of[block_id] = key
        self._block_of[key] = block_id

    def _uncache(self, block_id: int) -> None:
        del self._block_of[self._key_of.pop(block_id)]
