"""engine/runner/pinned_host.py: the swap space's layers are page-locked in place, each on its own 2 MiB-aligned
pages (two registrations may not share a page), and unlocked by the process itself when it leaves.  No GPU here:
the CUDA runtime's two calls are recorded by a stand-in with their signatures; tests/kernels/test_release_gpu.py
runs the real ones."""

from __future__ import annotations

import pytest
import torch

from engine.runner import pinned_host
from engine.runner.pinned_host import HUGE_PAGE, HostRegion
from engine.runner.swap_space import SwapSpace


class Cudart:
    """cudaHostRegister(ptr, size, flags) / cudaHostUnregister(ptr): 0 is cudaSuccess."""

    def __init__(self, refuse: bool = False) -> None:
        self.registered: dict[int, int] = {}
        self.refuse = refuse

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802  # the runtime's name
        if self.refuse:
            return 712  # cudaErrorHostMemoryAlreadyRegistered, say
        pages = {p // 4096 for p in range(ptr, ptr + size, 4096)} | {(ptr + size - 1) // 4096}
        for start, n in self.registered.items():
            assert not pages & set(range(start // 4096, (start + n - 1) // 4096 + 1)), "two registrations share a page"
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        del self.registered[ptr]
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> Cudart:
    fake = Cudart()
    monkeypatch.setattr(pinned_host.torch.cuda, "cudart", lambda: fake)
    return fake


def test_pieces_are_aligned_zeroed_registered_and_unregistered_on_release(cudart):
    region = HostRegion(3 * HUGE_PAGE)
    first = region.pin(0, HUGE_PAGE - 100)
    second = region.pin(HUGE_PAGE, 5000)
    assert first.data_ptr() % HUGE_PAGE == 0 and second.data_ptr() == first.data_ptr() + HUGE_PAGE
    assert int(first.sum()) == 0 and len(cudart.registered) == 2
    second.fill_(3)  # ordinary memory to torch
    with pytest.raises(ValueError, match="past the region"):
        region.pin(2 * HUGE_PAGE, HUGE_PAGE + 1)
    del first, second
    region.release()
    assert cudart.registered == {}


def test_a_pinned_swap_space_keeps_its_layers_on_separate_pages_and_unlocks_them_when_released(cudart):
    shape = (2, 3, 1000)  # 12,000 bytes a layer in float16: several layers would share a 2 MiB page if packed
    swap = SwapSpace(shape, torch.float16, layers=4, pin=True, background=False)
    blocks = swap.tensors()
    assert [b.shape for b in blocks] == [shape] * 4 and len(cudart.registered) == 4
    assert all(b.data_ptr() % HUGE_PAGE == 0 for b in blocks)
    blocks[2][1, 2, 999] = 5.0
    assert float(blocks[2][1, 2, 999]) == 5.0 and float(blocks[3].abs().sum()) == 0.0
    assert swap.release() == 4 * 12_000
    assert cudart.registered == {} and blocks == []


def test_a_refused_registration_falls_back_to_torchs_allocator(monkeypatch):
    refusing = Cudart(refuse=True)
    monkeypatch.setattr(pinned_host.torch.cuda, "cudart", lambda: refusing)
    made: list[bool] = []
    real_empty = torch.empty

    def empty(*args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(kwargs.get("pin_memory", False))
        kwargs["pin_memory"] = False  # no CUDA here to pin with
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    swap = SwapSpace((4, 4), torch.float32, layers=2, pin=True, background=False)
    assert len(swap.tensors()) == 2 and made == [True, True]  # torch's pinned allocator, once refused, for the rest


def test_release_pauses_between_pieces_so_that_other_processes_get_the_driver(cudart, monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr(pinned_host.time, "sleep", pauses.append)
    region = HostRegion(3 * HUGE_PAGE)
    for i in range(3):
        region.pin(i * HUGE_PAGE, 4096)
    region.release()
    assert cudart.registered == {} and pauses == [pinned_host.UNREGISTER_PAUSE_S] * 2  # between, not after


def test_a_region_dropped_without_release_is_unlocked_before_its_mapping_goes(cudart):
    """An engine closed in a process that goes on (the offline API, the GPU tests): the next region may be mapped at
    the same addresses, and the driver refuses to register pages that are still registered (cudaError 712)."""
    region = HostRegion(2 * HUGE_PAGE)
    piece = region.pin(0, HUGE_PAGE)
    assert len(cudart.registered) == 1
    del piece, region
    assert cudart.registered == {}


def test_closing_a_runner_unlocks_its_swap_space(cudart):
    from types import SimpleNamespace

    from engine.runner.model_runner import ModelRunner

    swap = SwapSpace((2, 3, 1000), torch.float16, layers=2, pin=True, background=False)
    swap.tensors()
    assert len(cudart.registered) == 2
    ModelRunner.close(SimpleNamespace(swap=swap))  # what LLM.close() reaches on one device and on TP's rank 0
    assert cudart.registered == {}
