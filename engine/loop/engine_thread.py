"""The one thread that does all of a server's model work: binding to cores, building the engine, then its step loop.

Why one thread: torch's CPU operators run on OpenMP, and OpenMP keeps a pool of worker threads per thread that starts a
parallel region.  When the engine was built on the main thread and stepped on another, the process held two pools, more
OpenMP threads than cores, and libgomp then stops spinning between regions (its "throttled" wait: every one of a step's
~150 regions wakes its workers through the kernel), and a decode step took a third longer
(docs/decisions/engine-thread.md).  So the server's engine is built on the thread that steps it, and the HTTP thread
starts no OpenMP region of its own.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

T = TypeVar("T")


class EngineThread:
    """A daemon thread that runs submitted callables in order (a daemon, unlike a ThreadPoolExecutor's worker:
    a step loop still running must not hold the process open at exit)."""

    def __init__(self, name: str = "engine-step-loop") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(e)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return future

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the thread and return its result (or raise its exception) here."""
        return self.submit(fn).result()

    def running(self, future: Future) -> bool:
        """True while `future`'s job has not finished (the thread is alive and has not left it)."""
        return self._thread.is_alive() and not future.done()

    @property
    def ident(self) -> int | None:
        return self._thread.ident
