"""Checkpoint bytes to GPU memory at the host's speed: several threads, pinned staging, one host copy.

A checkpoint tensor read through safetensors is a view of the memory-mapped file (no copy yet).  Copied to the
GPU directly, each tensor is a synchronous copy from pageable memory, staged by the driver one tensor at a time.
Here each of several threads copies its tensors into a pinned buffer of its own (the one host copy: page cache
to pinned memory, which releases the GIL) and from there to the device without blocking, on a CUDA stream of its
own, with two buffers so the next read overlaps the previous upload.  Large tensors go in row blocks.

`parallel_copies(device)` installs such a copier for the loads inside it (engine/model/weights.py's `copy_into`
asks `current_copier()`); everything else keeps copying directly.  Off CUDA the copy is a plain `copy_`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

import torch

STAGING_BYTES = 32 << 20  # per buffer; two per thread
MAX_THREADS = 8

Copier = Callable[[torch.Tensor, torch.Tensor], None]

_current: contextvars.ContextVar[Copier | None] = contextvars.ContextVar("pagekeeper_copier", default=None)


def current_copier() -> Copier | None:
    return _current.get()


class _ThreadState:
    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.next = 0


class DeviceCopier:
    """`copier(target, source)` queues the copy of a host tensor into a CUDA tensor of the same shape; `finish()`
    waits for all of them (and raises the first error)."""

    def __init__(self, device: torch.device, threads: int | None = None) -> None:
        self.device = device
        self.threads = threads or max(1, min(MAX_THREADS, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="weights-copy")
        self._local = threading.local()
        self._states: list[_ThreadState] = []
        self._states_lock = threading.Lock()
        self._futures: list[Future[None]] = []
        self.bytes = 0

    def __call__(self, target: torch.Tensor, source: torch.Tensor) -> None:
        if target.device.type != "cuda" or source.device.type != "cpu":
            target.copy_(source)
            return
        self.bytes += source.numel() * source.element_size()
        self._futures.append(self._pool.submit(self._copy, target, source))

    def _state(self) -> _ThreadState:
        state = getattr(self._local, "state", None)
        if state is None:
            with torch.cuda.device(self.device):
                state = _ThreadState(self.device)
            self._local.state = state
            with self._states_lock:
                self._states.append(state)
        return state

    def _copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        st = self._state()
        for t, s in _row_blocks(target, source):
            nbytes = s.numel() * s.element_size()
            i = st.next
            st.next ^= 1
            st.events[i].synchronize()  # the upload that last used this buffer is done
            staged = (
                st.buffers[i][:nbytes]
                if nbytes <= STAGING_BYTES
                else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            )
            staged = staged.view(s.dtype).view(s.shape)
            staged.copy_(s)
            with torch.cuda.stream(st.stream):
                t.copy_(staged, non_blocking=True)
                st.events[i].record(st.stream)
            if nbytes > STAGING_BYTES:
                st.stream.synchronize()  # a one-off buffer must outlive its upload

    def wait(self) -> None:
        """Every copy queued so far has landed (the first error is raised)."""
        futures, self._futures = self._futures, []
        try:
            for f in futures:
                f.result()
        finally:
            for f in futures:
                f.cancel()
            for st in self._states:
                st.stream.synchronize()

    def finish(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


def _row_blocks(target: torch.Tensor, source: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(target, source) in blocks of whole rows of at most STAGING_BYTES (one block when a row is larger)."""
    nbytes = source.numel() * source.element_size()
    if source.dim() == 0 or nbytes <= STAGING_BYTES or source.shape[0] < 2:
        yield target, source
        return
    row_bytes = max(1, nbytes // source.shape[0])
    rows = max(1, STAGING_BYTES // row_bytes)
    for start in range(0, source.shape[0], rows):
        n = min(rows, source.shape[0] - start)
        yield target.narrow(0, start, n), source.narrow(0, start, n)


@contextlib.contextmanager
def parallel_copies(device: torch.device) -> Iterator[DeviceCopier | None]:
    """Loads inside copy checkpoint tensors to `device` on several threads (CUDA only); all copies are done when
    the block ends."""
    if device.type != "cuda":
        yield None
        return
    copier = DeviceCopier(device)
    token = _current.set(copier)
    try:
        yield copier
    except BaseException:
        _current.reset(token)
        with contextlib.suppress(Exception):  # the error that ended the load is the one to report
            copier.finish()
        raise
    _current.reset(token)
    copier.finish()


def wait_for_copies() -> None:
    """Block until the copies queued by the current load have landed (before anything reads the weights)."""
    copier = _current.get()
    if isinstance(copier, DeviceCopier):
        copier.wait()
