"""Block tables: which physical KV blocks hold which sequence's tokens.

A sequence's KV for token position p lives in block `table[p // block_size]` at offset
`p % block_size`.  Blocks are taken on demand as tokens are appended, so a sequence never holds
more than one partly filled block (the internal fragmentation PagedAttention bounds), and all of a
sequence's blocks go back to the pool when it finishes, is aborted or is preempted.
"""

from __future__ import annotations

from engine.kv.block_pool import BlockPool


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> float:
        return self.pool.usage()

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """New blocks `seq_id` needs so that its table covers `num_tokens` token positions."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - have)

    def allocate_slots(self, seq_id: str, num_tokens: int) -> bool:
        """Grow the table to cover `num_tokens` positions; False (and no change) if blocks are short."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need == 0:
            return True
        if need > self.pool.num_free:
            return False
        self._tables.setdefault(seq_id, []).extend(self.pool.allocate(need))
        return True

    def free(self, seq_id: str) -> None:
        """Return every block of the sequence (finish, abort or preemption); a no-op if it holds none."""
        table = self._tables.pop(seq_id, None)
        if table:
            # Released last-first so that the tail of a long sequence is reused first.
            self.pool.release(table[::-1])

    def num_sequences(self) -> int:
        return len(self._tables)

    def tokens_capacity(self, seq_id: str) -> int:
        return len(self._tables.get(seq_id, ())) * self.block_size
