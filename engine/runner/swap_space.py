"""The swap space: host blocks that preempted sequences' KV moves to, pinned for fast copies.

Pinning gigabytes takes seconds, and while a pinned allocation runs every other CUDA call of the process waits for
the driver's lock: a step's kernel launches wait behind it.  A restarted engine's first step waited so behind a
thread pinning its swap space (docs/decisions/swap-space-thread.md), and so did a cold start's first request
(2.2 s on one H100, 7.2 s at TP=4 with 8 GiB per rank) although the thread paused between layers.  So:
- a standby engine pins its swap space on a thread while the engine it replaces still serves (host memory, not
  device memory; nothing of its own runs yet), and a CUDA graph capture, which forbids such allocations in any
  thread, waits for that thread;
- a cold start pins it on the step loop's own thread, one layer per unit of deferred start-up work
  (engine/runner/deferred.py), paced between steps like a graph capture, so that no launch ever waits for it.
The first swap, only under memory pressure, allocates what is still missing at once if it must.

A leaving process unpins it itself (`release`) rather than leave it to the driver's teardown of its exit: that
teardown held every other process's allocations on the GPU for seconds, the successor's among them
(docs/decisions/unpin-before-exit.md).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import structlog
import torch

from engine.runner.pinned_host import HUGE_PAGE, HostRegion

log = structlog.get_logger("pagekeeper.engine")

# Between two layers' allocations.  Pinned allocations are serialized: without a pause the thread took the lock back at
# once, and a cold start's first step at TP=4 (8 GiB of swap per rank) waited seconds for its few pinned bytes.
YIELD_S = 0.002


class SwapSpace:
    """`layers` tensors of `shape` (one per layer, the device cache's layout): allocated on a thread of their own
    (`background`), or by the caller, one layer per step of `allocation_steps` or all at once by `tensors`."""

    def __init__(
        self, shape: tuple[int, ...], dtype: torch.dtype, layers: int, pin: bool, background: bool = True
    ) -> None:
        self.shape, self.dtype, self.layers, self.pin = shape, dtype, layers, pin
        self._tensors: Future[list[torch.Tensor]] = Future()
        self._blocks: list[torch.Tensor] = []  # the caller's allocation so far
        self._stop = threading.Event()  # `release`: the allocating thread stops and drops what it pinned
        self._region: HostRegion | None = None  # pinned layers live here (engine/runner/pinned_host.py)
        self._region_refused = not pin
        self.background = background
        if not layers or 0 in shape or not shape:
            self._tensors.set_result([])
            return
        if not background:
            return

        def allocate() -> None:
            try:
                blocks: list[torch.Tensor] = []
                for _ in range(layers):
                    if self._stop.is_set():  # `release` drops what was pinned so far
                        break
                    blocks.append(self._new_block(len(blocks)))
                    time.sleep(YIELD_S)  # the step loop's own pinned allocations get their turn between layers
                self._tensors.set_result(blocks)
            except BaseException as e:  # raised where the swap space is first needed
                self._tensors.set_exception(e)

        threading.Thread(target=allocate, name="swap-space", daemon=True).start()

    @classmethod
    def empty(cls) -> SwapSpace:
        return cls((), torch.float32, 0, False)

    def ready(self) -> bool:
        return self._tensors.done()

    def quiet(self) -> bool:
        """No pinned allocation can be running on another thread now (a CUDA graph capture may run)."""
        return not self.background or self._tensors.done()

    def allocation_steps(self) -> Iterator[None]:
        """One layer per step, on the caller's thread (nothing for a background allocation)."""
        while not self._tensors.done():
            self._allocate_one()
            yield

    def _new_block(self, index: int) -> torch.Tensor:
        """Layer `index`'s block: page-locked in the huge-page region where the driver allows, else from torch's
        pinned allocator (or pageable memory when not pinning)."""
        if not self._region_refused:
            layer_bytes = math.prod(self.shape) * self.dtype.itemsize
            slot = -(-layer_bytes // HUGE_PAGE) * HUGE_PAGE  # no two layers share a page: each registers alone
            try:
                if self._region is None:
                    self._region = HostRegion(slot * self.layers)
                return self._region.pin(index * slot, layer_bytes).view(self.dtype).view(self.shape)
            except (OSError, RuntimeError, AssertionError) as e:  # no huge-page region or registration here
                self._region_refused = True
                if self._region is not None and not index:  # nothing of it is in use: the mapping goes
                    self._region.release()
                    self._region = None
                log.warning("swap_space_pinned_by_torch", reason=str(e)[:200], effect="slower to pin and to exit")
        return torch.empty(self.shape, dtype=self.dtype, pin_memory=self.pin)

    def _allocate_one(self) -> None:
        self._blocks.append(self._new_block(len(self._blocks)))
        if len(self._blocks) == self.layers:
            self._tensors.set_result(self._blocks)

    def release(self, wait_s: float = 10.0) -> int:
        """Drop every block (the process is leaving: nothing swaps any more); the bytes dropped.  A thread still
        pinning stops after its current layer (waited for up to `wait_s`).  The huge-page region is unlocked here;
        blocks from torch's pinned allocator stay locked until its cache is emptied (engine/runner/release.py)."""
        self._stop.set()
        blocks = self._blocks
        if self._tensors.done():
            blocks = self._tensors.result() if self._tensors.exception() is None else []
        elif self.background:
            try:
                blocks = self._tensors.result(timeout=wait_s)
            except Exception:  # still pinning past the wait, or it failed: whatever it holds goes with the exit
                return 0
        dropped = sum(b.numel() * b.element_size() for b in blocks)
        blocks.clear()  # the runner reads the same list: nothing refers to the blocks any more
        self._blocks.clear()
        if self._region is not None:
            self._region.release()  # unlocked here, by this process, not by its exit's teardown
            self._region = None
        return dropped

    def tensors(self) -> list[torch.Tensor]:
        """The blocks, one tensor per layer (waits for the allocating thread, or allocates what is missing)."""
        while not self.background and not self._tensors.done():
            self._allocate_one()
        return self._tensors.result()
