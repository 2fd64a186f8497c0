"""Page-locked host memory on transparent huge pages, pinned in place with cudaHostRegister.

The swap space is gigabytes of page-locked memory per GPU.  Taken from torch's pinned allocator it costs in three
places: pinning is slow (4 KiB pages, each size rounded up to a power of two), a process that exits with it leaves
the unpinning to the driver's teardown, which held every other process's cudaMalloc for seconds (a restart's or a
kill -9's successor allocating its KV cache), and it is a quarter larger than asked.  An anonymous mapping advised
to use 2 MiB pages and registered in place pinned 4x faster and exited 5x faster in the same measurement
(docs/decisions/unpin-before-exit.md).  Where registration is refused, the caller falls back to torch's pinned
allocator.
"""

from __future__ import annotations

import mmap
import time
import weakref

import torch

HUGE_PAGE = 2 << 20
# Between two pieces' unregistrations.  Back to back, the leaving ranks of a TP=4 engine held the driver for the 2 s
# their 8 GiB each took to unpin, and the successor's first graph capture waited that long; a pause lets the
# successor's calls in between, as the swap space's paced pinning does for a step's launches.
UNREGISTER_PAUSE_S = 0.005


class HostRegion:
    """`nbytes` of anonymous memory, reserved at once and faulted in by `pin` one piece at a time."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        # one huge page more, so that the usable start can sit on a 2 MiB boundary (THP maps only aligned ranges)
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self._whole = torch.frombuffer(self._map, dtype=torch.uint8)
        skip = -self._whole.data_ptr() % HUGE_PAGE
        self._bytes = self._whole[skip : skip + nbytes]
        self._registered: list[int] = []  # addresses given to cudaHostRegister, for cudaHostUnregister
        # A region dropped without release() (an engine closed in a process that goes on): its pages are unlocked
        # before the mapping goes, else the next mapping at the same addresses is refused as already registered.
        weakref.finalize(self, _unregister_all, self._registered)

    def pin(self, offset: int, nbytes: int) -> torch.Tensor:
        """The bytes [offset, offset + nbytes), faulted in and page-locked (RuntimeError if the driver refuses)."""
        piece = self._bytes[offset : offset + nbytes]
        if piece.numel() != nbytes:
            raise ValueError(f"{nbytes} bytes at {offset} lie past the region's {self.nbytes}")
        piece.fill_(0)  # the pages exist (huge where the kernel can) before the driver locks them
        err = int(torch.cuda.cudart().cudaHostRegister(piece.data_ptr(), nbytes, 0))
        if err != 0:
            clear_last_cuda_error()
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: cudaError {err}")
        self._registered.append(piece.data_ptr())
        return piece

    def release(self, pause_s: float = UNREGISTER_PAUSE_S) -> None:
        """Unlock every pinned piece here, not in the exit's teardown, pausing `pause_s` between pieces; the mapping
        goes when no tensor refers to it."""
        _unregister_all(self._registered, pause_s)
        del self._bytes, self._whole
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive somewhere: the mapping goes with the last reference
            pass


def _unregister_all(registered: list[int], pause_s: float = 0.0) -> None:
    """cudaHostUnregister every address in `registered` (emptied), pausing `pause_s` between two."""
    if not registered:
        return
    cudart = torch.cuda.cudart()
    while registered:
        cudart.cudaHostUnregister(registered.pop())
        if registered and pause_s:
            time.sleep(pause_s)


def clear_last_cuda_error() -> bool:
    """Read (and so reset) the CUDA runtime's last error on this thread; whether it could.  A refused
    cudaHostRegister leaves its error there, and torch's check after the next kernel launch raised it (the
    engine's first step failed with "part or all of the requested memory range is already mapped").  torch's
    `cudart()` module has no cudaGetLastError, so the runtime library this process loaded is called directly."""
    import ctypes

    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
    except OSError:
        return False
    for path in sorted(paths):
        try:
            ctypes.CDLL(path).cudaGetLastError()
            return True
        except (OSError, AttributeError):
            continue
    return False
