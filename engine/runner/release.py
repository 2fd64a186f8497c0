"""A serving process frees its device memory before it exits, and says so to the engine that replaces it.

A restart's successor waits in standby until the engine it replaces has freed the GPU (engine/lifecycle.py).
Waiting for the process to exit made that wait include the driver's teardown of every process of the old engine
(at TP=4 the ranks' exits came one after the other: seconds).  Instead each process of the old engine, once it
has stopped stepping, drops its KV cache and graphs, returns the allocator's cache to the driver, and writes a
marker (`announce_released`): the successor counts it as gone and allocates while the old process finishes its
exit.  A process that still holds more than RELEASE_SLACK_BYTES announces nothing: its successor waits for the
exit, as before.

After the marker, the process unpins its swap space itself: left to the exit, the driver's teardown of gigabytes of
pinned pages held every other process's cudaMalloc and pinned allocation for seconds (the successor's KV cache and
graph pools among them), while unpinning them before the exit delayed nobody's calls by more than tens of ms
(docs/decisions/unpin-before-exit.md)."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import structlog
import torch

from engine.lifecycle import PROCESS_EXIT, announce_released, retract_released

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner

log = structlog.get_logger("pagekeeper.engine")

# What a process may still hold (the allocator's reserved bytes: small buffers of the model, the sampler's rows) and
# be counted as gone; the CUDA context and NCCL's buffers are outside the allocator and come on top.
RELEASE_SLACK_BYTES = 1 << 30


def release_for_successor(runner: ModelRunner) -> bool:
    """Free `runner`'s device memory and announce it (True) unless more than the slack stays reserved (False).

    Only for a process that is exiting: the runner cannot step afterwards."""
    if runner.device.type != "cuda":
        return False
    started = time.monotonic()
    try:
        torch.cuda.synchronize(runner.device)  # the last plan's kernels, and its collectives with the other ranks
        runner.drop_device_state()
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved(runner.device)
        if held > RELEASE_SLACK_BYTES:  # something still refers to a graph or the cache through a cycle
            gc.unfreeze()
            gc.collect()
            torch.cuda.empty_cache()
            held = torch.cuda.memory_reserved(runner.device)
    except Exception as e:  # a device error (the reason this core leaves): the successor waits for the exit
        log.warning("device_memory_release_failed", error=str(e)[:300], effect="the successor waits for the exit")
        return False
    announced = held <= RELEASE_SLACK_BYTES and announce_released(held)
    log.info(
        "device_memory_released",
        seconds=round(time.monotonic() - started, 3),
        held_bytes=held,
        announced=announced,
    )
    release_pinned_memory(runner)
    return announced


def release_pinned_memory(runner: ModelRunner) -> int:
    """Unpin the swap space and the host allocator's cached pinned blocks before the exit (the module's docstring
    says why); the swap space's bytes.  Only for a process that is leaving: nothing can swap afterwards."""
    started = time.monotonic()
    try:
        dropped = runner.swap.release()
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)  # CUDA builds only
        if empty_host_cache is not None:
            empty_host_cache()  # the caching host allocator's blocks go back: cudaFreeHost here, not in the exit
    except Exception as e:  # the exit's teardown frees them as before
        log.warning("pinned_memory_release_failed", error=str(e)[:300])
        return 0
    if dropped:
        log.info("pinned_memory_released", seconds=round(time.monotonic() - started, 3), swap_bytes=dropped)
    return dropped


@contextmanager
def released_while_standing_by(device: torch.device) -> Iterator[None]:
    """A process standing by holds its CUDA context and little else (its weights are the keeper's, its warm-ups'
    buffers are freed here): it says so as a leaving process does, so that whoever waits for the engine it belongs to
    does not wait for its exit.  A spare killed with the front it stood behind took 7 s to exit at TP=4 (its ranks'
    teardown), and the restart's successor waited for all of it.  The marker goes before this process takes device
    memory (a spare promoted), so that from then on it counts as holding memory again."""
    held = 0  # on a CPU nothing of the KV cache is allocated before the standby ends
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved(device)
    announced = held <= RELEASE_SLACK_BYTES and announce_released(held)
    yield  # an exception (its supervisor or rank 0 gone, the standby's limit) means this process leaves: it stays
    if announced:  # announced, and whoever waits for it does not wait for its exit (a killed spare's ranks: 7 s)
        retract_released()


def release_at_exit(runner: ModelRunner) -> None:
    """Register the release for this process's exit through `exit_without_teardown` (a server or an engine core);
    an offline script's orderly exit, and a runner already collected, are left alone."""
    import atexit

    ref = weakref.ref(runner)

    def release() -> None:
        found = ref()
        if found is not None and PROCESS_EXIT.without_teardown:
            release_for_successor(found)

    atexit.register(release)
