"""The swap space: host blocks that preempted sequences' KV moves to, pinned for fast copies, allocated on a thread.

Pinning gigabytes takes seconds, and while it runs the process's other CUDA host allocations wait for it: a restarted
engine's first step, whose sampled tokens land in pinned memory, waited behind it (docs/decisions/swap-space-thread.md).
So the allocation starts as early as its size is known: a standby engine pins its swap space while the engine it
replaces still serves (host memory, not device memory), a cold start as soon as its KV plan is made, pausing between
layers so that a serving step's own pinned allocations are not starved.  The first swap, only under memory pressure,
waits for the thread if it must, and so does a CUDA graph capture, which forbids such allocations in any thread.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import torch

# Between two layers' allocations.  Pinned allocations are serialized: without a pause the thread took the lock back at
# once, and a cold start's first step at TP=4 (8 GiB of swap per rank) waited seconds for its few pinned bytes.
YIELD_S = 0.002


class SwapSpace:
    """`layers` tensors of `shape` (one per layer, the device cache's layout), allocated on a thread of their own."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, layers: int, pin: bool) -> None:
        self.shape, self.dtype, self.layers = shape, dtype, layers
        self._tensors: Future[list[torch.Tensor]] = Future()
        if not layers or 0 in shape or not shape:
            self._tensors.set_result([])
            return

        def allocate() -> None:
            try:
                blocks = []
                for _ in range(layers):
                    blocks.append(torch.empty(shape, dtype=dtype, pin_memory=pin))
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

    def tensors(self) -> list[torch.Tensor]:
        """The blocks, one tensor per layer (waits for the allocating thread)."""
        return self._tensors.result()
