"""Two CPU engines on one machine during a handover: each runs half of the model threads until the old one leaves.

A restart with `handover = "overlap"` (opsctl's default on CPU) runs the new engine beside the old one: the new one
loads and serves while the old one finishes what it accepted.  Each engine's OpenMP workers spin between a step's
many small parallel regions, so two full thread teams on the same cores take turns spinning at each other's
barriers: both at full width, the old engine's drain ran 7-11x slower than alone (docs/decisions/core-share.md).
So, during the overlap:

- the new engine starts with `--share-cores-with PID` (the engine it replaces): it loads and serves with half the
  threads, and takes them all back once that process is gone (checked twice a second on its step loop, so a
  supervisor that dies mid-handover cannot leave it at half width);
- the old engine, told to hand over to a successor that serves already, drops to the other half.

Threads change on the engine thread between steps (torch's setting belongs to the thread that runs the model).
"""

from __future__ import annotations

import os
import threading
import time

import structlog

log = structlog.get_logger("pagekeeper.server")

CHECK_INTERVAL_S = 0.5


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie its parent has not reaped yet counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except OSError:
        return True


class CoreShare:
    """The model's thread count while another engine shares the cores; call it on the engine thread each loop."""

    def __init__(self, full: int, predecessor: int | None = None) -> None:
        self.full = max(1, full)
        self.predecessor = predecessor
        self._lock = threading.Lock()
        self._target = max(1, self.full // 2) if predecessor is not None else self.full
        self._reason = "sharing with the engine being replaced" if predecessor is not None else ""
        self._next_check = 0.0
        self.applied = 0  # the thread count last set (0: nothing yet)
        self._logged = ""

    @property
    def target(self) -> int:
        with self._lock:
            return self._target

    def yield_to_successor(self) -> None:
        """Thread-safe (the control thread): this engine hands over to one that serves; keep the other half."""
        with self._lock:
            self._target = max(1, self.full - self.full // 2)
            self._reason = "handing over to a successor that serves"
            self.predecessor = None

    def __call__(self) -> None:
        with self._lock:
            if self.predecessor is not None and time.monotonic() >= self._next_check:
                self._next_check = time.monotonic() + CHECK_INTERVAL_S
                if process_gone(self.predecessor):
                    self._target, self._reason = self.full, f"engine {self.predecessor} has exited"
                    self.predecessor = None
            target, reason = self._target, self._reason
        if target != self.applied:
            import torch  # here, not at the top: the server imports this module before it checks its flags

            torch.set_num_threads(target)
            self.applied = target
        if reason != self._logged:  # each change of who shares the cores is logged once, even at one thread
            log.info("cpu_threads_shared", torch_threads=target, of=self.full, reason=reason)
            self._logged = reason
