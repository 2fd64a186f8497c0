"""Block tables: which physical KV blocks hold which sequence's tokens.

A sequence's KV for token position p lives in block `table[p // block_size]` at offset
`p % block_size`.  Blocks are taken on demand as tokens are appended, so a sequence never holds
more than one partly filled block (the internal fragmentation PagedAttention bounds), and all of a
sequence's blocks go back to the pool when it finishes, is aborted or is preempted.

This manager decides *which* blocks; it never touches tensors.  Data movement it requires (copy a
shared block before writing it, swap blocks to and from CPU) is appended to `ops`, which the model
runner executes before the next forward, in the order swap-out, swap-in, copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv.block_pool import BlockKey, BlockPool


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class KVOps:
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copies)


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, num_cpu_blocks: int = 0
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[int]] = {}
        self._keys: dict[str, list[BlockKey]] = {}  # keys of each sequence's full, computed blocks
        self._cpu_tables: dict[str, list[int]] = {}
        self.ops = KVOps()
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found there
        self.cow_copies = 0  # shared partial blocks copied before a write
        self.blocks_swapped_out = 0

    # -- counts -------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_pool.num_blocks if self.cpu_pool else 0

    def usage(self) -> float:
        return self.pool.usage()

    def cpu_usage(self) -> float:
        return self.cpu_pool.usage() if self.cpu_pool else 0.0

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_sequences(self) -> int:
        return len(self._tables)

    def num_swapped(self) -> int:
        return len(self._cpu_tables)

    def tokens_capacity(self, seq_id: str) -> int:
        return len(self._tables.get(seq_id, ())) * self.block_size

    def num_held_blocks(self) -> int:
        """Blocks some owner holds (live sequences, or a leak)."""
        return self.pool.num_used

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the blocks become plain free ones); only while no sequence holds blocks."""
        if self._tables:
            raise RuntimeError("the prefix cache is reset only while no sequence holds KV blocks")
        self.rebuild()

    def rebuild(self) -> int:
        """A new device pool: every block free, the prefix cache empty, blocks that leaked (held by no sequence
        this manager knows) reclaimed; returns how many that was.  Only while no sequence holds device blocks
        (swapped sequences keep their CPU blocks)."""
        if self._tables:
            raise RuntimeError(f"{len(self._tables)} sequence(s) still hold KV blocks: preempt them first")
        leaked = self.pool.num_used
        evictions = self.pool.evictions
        self.pool = BlockPool(self.pool.num_blocks)
        self.pool.evictions = evictions
        self._keys.clear()
        self.ops.copies.clear()
        return leaked

    def take_ops(self) -> KVOps:
        ops, self.ops = self.ops, KVOps()
        return ops

    # -- growing and freeing ------------------------------------------------------------------

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """New blocks `seq_id` needs so that its table covers `num_tokens` token positions."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - have)

    def allocate_slots(self, seq_id: str, num_tokens: int, start: int | None = None) -> bool:
        """Cover positions up to `num_tokens`, writing from `start`; False (and no change) if short.

        When the write begins inside a partly filled block that another sequence shares (after a
        fork), that block is first copied to a private one: copy-on-write.
        """
        table = self._tables.setdefault(seq_id, [])
        need = max(0, blocks_for_tokens(num_tokens, self.block_size) - len(table))
        cow: int | None = None  # the shared, partly filled block the write begins in (its index in the table)
        if start is not None and start % self.block_size != 0:
            i = start // self.block_size
            if i < len(table) and self.pool.ref_count(table[i]) > 1:
                cow = i
        if need + (cow is not None) > self.pool.num_free:
            if not table:
                del self._tables[seq_id]
            return False
        if cow is not None:
            i = cow
            (private,) = self.pool.allocate(1)
            self.ops.copies.append((table[i], private))
            self.cow_copies += 1
            self.pool.release([table[i]])
            table[i] = private
        if need:
            table.extend(self.pool.allocate(need))
        return True

    def free(self, seq_id: str) -> None:
        """Return every block of the sequence (finish, abort or preemption); a no-op if it holds none."""
        table = self._tables.pop(seq_id, None)
        self._keys.pop(seq_id, None)
        if table:
            # Released last-first, so the tail of a long sequence is evicted before its prefix.
            self.pool.release(table[::-1])
        cpu = self._cpu_tables.pop(seq_id, None)
        if cpu and self.cpu_pool:
            self.cpu_pool.release(cpu)

    # -- prefix caching -----------------------------------------------------------------------

    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Blocks already holding the longest cached prefix of `token_ids` (no ownership taken).

        At least one token is always left to compute: the model must produce the next logits.
        """
        if not self.prefix_caching:
            return []
        bs = self.block_size
        blocks: list[int] = []
        key = None
        for j in range((len(token_ids) - 1) // bs):
            key = self.pool.key(key, token_ids[j * bs : (j + 1) * bs])
            b = self.pool.peek(key)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def can_admit(self, cached: list[int], num_tokens: int) -> bool:
        """Would `admit(..., cached, num_tokens)` succeed?  Cached blocks nobody holds count as free
        until taken, so taking them shrinks what is left for the new ones."""
        new = blocks_for_tokens(num_tokens, self.block_size) - len(cached)
        taken_from_free = sum(1 for b in cached if self.pool.ref_count(b) == 0)
        return new <= self.pool.num_free - taken_from_free

    def admit(self, seq_id: str, token_ids: list[int], cached: list[int], num_tokens: int) -> None:
        """Give a sequence with no blocks its cached prefix plus new blocks up to `num_tokens`."""
        assert seq_id not in self._tables, "admit is for sequences that hold no blocks"
        keys = []
        key = None
        for j, b in enumerate(cached):
            key = self.pool.key(key, token_ids[j * self.block_size : (j + 1) * self.block_size])
            got = self.pool.lookup(key)
            assert got == b, "the prefix cache changed between cached_prefix and admit"
            keys.append(key)
        self._tables[seq_id] = list(cached)
        self._keys[seq_id] = keys
        if self.prefix_caching:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += len(cached) * self.block_size
        ok = self.allocate_slots(seq_id, num_tokens)
        assert ok, "admit without can_admit"

    def cache_full_blocks(self, seq_id: str, token_ids_of: Callable[[int, int], list[int]], num_computed: int) -> None:
        """Register blocks that became full and computed, so later requests can share them.

        `token_ids_of(start, end)` returns the sequence's tokens in [start, end).
        """
        if not self.prefix_caching:
            return
        table = self._tables.get(seq_id)
        if not table:
            return
        keys = self._keys.setdefault(seq_id, [])
        bs = self.block_size
        for j in range(len(keys), min(num_computed // bs, len(table))):
            key = self.pool.key(keys[-1] if keys else None, token_ids_of(j * bs, (j + 1) * bs))
            self.pool.cache(table[j], key)
            keys.append(key)

    # -- fork (n > 1) -----------------------------------------------------------------------------

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (copy-on-write protects the partial one)."""
        table = self._tables[parent_id]
        self.pool.share(table)
        self._tables[child_id] = list(table)
        self._keys[child_id] = list(self._keys.get(parent_id, []))

    # -- swap -----------------------------------------------------------------------------------

    def can_swap_out(self, seq_id: str) -> bool:
        return self.cpu_pool is not None and self.cpu_pool.num_free >= len(self._tables.get(seq_id, ()))

    def swap_out(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, [])
        self._keys.pop(seq_id, None)
        assert self.cpu_pool is not None
        cpu = self.cpu_pool.allocate(len(table))
        self.ops.swap_out.extend(zip(table, cpu))
        self.blocks_swapped_out += len(table)
        self.pool.release(table[::-1])
        self._cpu_tables[seq_id] = cpu

    def can_swap_in(self, seq_id: str, num_tokens: int) -> bool:
        """Room for the swapped blocks plus what the next `num_tokens` positions need."""
        have = len(self._cpu_tables[seq_id])
        return max(have, blocks_for_tokens(num_tokens, self.block_size)) <= self.pool.num_free

    def swap_in(self, seq_id: str) -> None:
        cpu = self._cpu_tables.pop(seq_id)
        gpu = self.pool.allocate(len(cpu))
        self.ops.swap_in.extend(zip(cpu, gpu))
        assert self.cpu_pool is not None
        self.cpu_pool.release(cpu)
        self._tables[seq_id] = gpu
