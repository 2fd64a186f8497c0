"""Keep the garbage collector's full passes off the step loop.

A full (generation-2) collection walks every object the collector tracks, the model, torch's modules and the KV
pool included: the host stalls while it runs and the device, out of queued steps, sits idle.  What start-up built
lives as long as the engine, so scanning it again finds nothing: `gc.freeze()` moves it to the collector's
permanent generation, and later passes walk only what was made since (docs/decisions/gc-heap.md).

- A process that exists for one engine (the server, a tensor-parallel rank) freezes its heap once, after
  start-up: `freeze_startup_heap`.  While it starts, the collector is paused (`pause_startup_collections`):
  its automatic passes walked the growing start-up heap again and again and found little; the freeze's one pass
  then frees that garbage.
  The imported modules are frozen before the engine is built, uncollected (`freeze_imported_heap`), so that
  the final pass walks only what the engine built, where garbage that holds device memory would be.
- The offline API runs inside the caller's process, whose other objects it must not keep alive: `frozen_heap`
  freezes for one run of steps and hands everything back to the collector afterwards, so an engine the caller
  drops is still freed.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_process_frozen = False  # freeze_startup_heap ran: the heap stays frozen, frozen_heap has nothing to do
_runs = 0  # frozen_heap blocks now running (threads may run two offline engines at once)
_startup_paused = False  # pause_startup_collections turned the collector off


def pause_startup_collections() -> None:
    """No automatic collection until `freeze_startup_heap` (or `resume_startup_collections`, for a start that
    fails before it) turns the collector back on."""
    global _startup_paused
    with _lock:
        if gc.isenabled():
            gc.disable()
            _startup_paused = True


def resume_startup_collections() -> None:
    """The collector back on if `pause_startup_collections` turned it off (a no-op otherwise)."""
    global _startup_paused
    with _lock:
        if _startup_paused:
            gc.enable()
            _startup_paused = False


def freeze_imported_heap() -> int:
    """In a process whose start-up paused the collector, freeze what exists before the engine is built: the
    modules it imported, which live as long as it does.  Without a collection pass: `freeze_startup_heap`'s
    pass then walks only what the engine builds (the embedded model's server: 330,000 objects, 0.3 s of CPU,
    not walked).  The garbage the imports left (7,600 objects, 0.8 MB there) stays frozen with them.  Elsewhere
    (the offline API, in its caller's process) it does nothing.  Returns how many objects are frozen."""
    with _lock:
        if _startup_paused:
            gc.freeze()
        return gc.get_freeze_count()


def freeze_startup_heap() -> int:
    """Collect start-up's garbage once, then put every object left out of the collector's reach for the rest
    of the process, and resume a paused collector; returns how many objects that froze (logged at start-up)."""
    global _process_frozen
    with _lock:
        gc.collect()
        gc.freeze()
        _process_frozen = True
        frozen = gc.get_freeze_count()
    resume_startup_collections()
    return frozen


def thaw() -> None:
    """Give the frozen objects back to the collector (before a teardown that needs a full collection to free
    objects made at start-up, such as CUDA graphs that hold an NCCL communicator)."""
    global _process_frozen
    with _lock:
        gc.unfreeze()
        _process_frozen = False


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze what exists now for the duration of the block, then unfreeze (the last of overlapping blocks
    does).  Freezing and unfreezing move whole lists, so a block costs microseconds, not a collection."""
    global _runs
    with _lock:
        counted = not _process_frozen  # a process frozen for good has nothing to give back afterwards
        if counted:
            if _runs == 0:
                gc.freeze()
            _runs += 1
    try:
        yield
    finally:
        with _lock:
            if counted:
                _runs -= 1
                if _runs == 0 and not _process_frozen:
                    gc.unfreeze()
