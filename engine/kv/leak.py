"""A KV leak on purpose (the `--enable-debug-hooks` fault): blocks that no sequence will ever give back.

Lives beside the KV manager so that both a core in the server process (engine/server/debug_hooks.py) and one in
its own process (engine/loop/core_main.py) can be told to leak, and the supervisor's stuck-cache cure tested.
"""

from __future__ import annotations

from typing import Any

import structlog

log = structlog.get_logger("pagekeeper.server")


class KVLeak:
    def __init__(self, kv: Any) -> None:
        self._kv = kv  # the engine's KV cache manager (engine/kv/kv_cache_manager.py)
        self._leak = 0  # blocks still to leak
        self._leave = 0  # free blocks the leak leaves
        self._pool: Any = None  # the pool the leak was asked of (a recycle makes a new one: the leak ends)
        self.leaked = 0

    def start(self, blocks: int, leave: int) -> None:
        self._leak, self._leave = blocks, leave
        self._pool = self._kv.pool
        log.warning("kv_leak_requested", blocks=blocks, leave=leave)

    def step(self) -> None:
        """A step-loop hook: take free blocks from the pool, leaving `leave` free, at every iteration (blocks that
        requests give back are taken too) until `blocks` are taken or the pool is rebuilt (a recycle, which also
        frees them) or the engine restarts."""
        if not self._leak:
            return
        pool = self._kv.pool
        if pool is not self._pool:
            self._leak = 0  # the pool was rebuilt: this leak is over
            return
        n = min(self._leak, pool.num_free - self._leave)
        if n > 0:
            pool.allocate(n)
            self._leak -= n
            self.leaked += n
            log.warning("kv_blocks_leaked", blocks=n, total=self.leaked, usage=round(self._kv.usage(), 4))
