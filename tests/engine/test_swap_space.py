"""engine/runner/swap_space.py: a standby engine's swap space is allocated on a thread while the engine it replaces
still serves, and a runner given one uses it; a cold start's is allocated on the step loop's own thread, a layer per
unit of deferred work (a pinning thread held up a cold start's first steps), or at once by the first swap.  A leaving
process drops it (`release`), also while a thread still pins it."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.config import EngineConfig
from engine.core.plan import StepPlan
from engine.loop.llm_engine import LLMEngine
from engine.runner.swap_space import SwapSpace


@contextmanager
def threads_that_allocate() -> Iterator[list[str]]:
    """The names of the threads that call torch.empty meanwhile, in order."""
    seen: list[str] = []
    real_empty = torch.empty

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(threading.current_thread().name)
        return real_empty(*args, **kwargs)

    torch.empty = spy  # type: ignore[assignment]
    try:
        yield seen
    finally:
        torch.empty = real_empty  # type: ignore[assignment]


def test_blocks_are_allocated_on_a_thread_of_their_own():
    with threads_that_allocate() as seen:
        swap = SwapSpace((3, 2, 4), torch.float16, layers=2, pin=False)
        blocks = swap.tensors()
    assert swap.ready() and len(blocks) == 2 and blocks[0].shape == (3, 2, 4) and blocks[0].dtype == torch.float16
    assert seen == ["swap-space", "swap-space"]
    assert SwapSpace.empty().tensors() == [] and SwapSpace((0, 2), torch.float16, 4, False).tensors() == []


def test_a_swap_space_on_the_callers_thread_allocates_a_layer_per_step_or_the_rest_when_read():
    with threads_that_allocate() as seen:
        swap = SwapSpace((3, 2, 4), torch.float16, layers=3, pin=False, background=False)
        assert seen == [] and swap.quiet() and not swap.ready()  # nothing yet, and no thread: captures may run
        steps = swap.allocation_steps()
        next(steps)
        assert len(seen) == 1 and not swap.ready()
        blocks = swap.tensors()  # the first swap: what is missing, now
    assert swap.ready() and len(blocks) == 3 and seen == [threading.current_thread().name] * 3
    assert list(steps) == []  # the deferred job finds nothing left
    background = SwapSpace((3, 2, 4), torch.float16, layers=1, pin=False)
    background.tensors()
    assert background.quiet() and list(background.allocation_steps()) == []


def test_a_cold_runner_allocates_its_swap_space_on_the_step_loop_not_on_a_thread():
    engine = LLMEngine(EngineConfig(device="cpu", preemption_mode="swap", swap_space=0.01))
    swap = engine.core.runner.swap
    assert swap.background is False and swap.quiet()


def test_an_allocation_error_is_raised_where_the_blocks_are_needed():
    swap = SwapSpace((-1, 2), torch.float16, layers=1, pin=False)
    try:
        swap.tensors()
    except RuntimeError:
        pass
    else:
        raise AssertionError("a negative shape must fail where the swap space is read")


def test_a_runner_swaps_through_the_swap_space_its_start_up_began():
    engine = LLMEngine(EngineConfig(device="cpu", preemption_mode="swap", swap_space=0.01))
    core, runner = engine.core, engine.core.runner
    blocks = runner.swap.tensors()
    assert len(blocks) == len(runner.kv_caches) == len(runner.cpu_caches)
    cache = runner.kv_caches[0]  # [K/V, blocks, ...]
    assert blocks[0].shape[2:] == cache.shape[2:] and blocks[0].shape[1] == core.kv.num_cpu_blocks > 5
    cache[:, 3].fill_(7.0)
    runner.apply(StepPlan(swap_out=[(3, 5)]))  # device block 3 out to host block 5
    assert torch.equal(blocks[0][:, 5], cache[:, 3])


def test_a_released_swap_space_drops_its_blocks():
    swap = SwapSpace((3, 2, 4), torch.float16, layers=3, pin=False, background=False)
    blocks = swap.tensors()
    first = weakref.ref(blocks[0].untyped_storage())
    assert swap.release() == 3 * 3 * 2 * 4 * 2
    assert blocks == [] and swap.tensors() == []  # the runner's view of the list is empty too
    gc.collect()
    assert first() is None  # nothing else refers to the pages: the host allocator may give them back


def test_releasing_stops_a_thread_still_pinning_after_its_current_layer():
    real_empty = torch.empty
    started = threading.Event()

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        started.set()
        time.sleep(0.02)
        return real_empty(*args, **kwargs)

    torch.empty = slow  # type: ignore[assignment]
    try:
        swap = SwapSpace((4,), torch.float32, layers=200, pin=False)
        assert started.wait(5)
        dropped = swap.release()
    finally:
        torch.empty = real_empty  # type: ignore[assignment]
    assert 0 < dropped < 200 * 16  # it stopped long before the 200th layer (4 s at 20 ms each)
    assert swap.ready() and swap.tensors() == []
