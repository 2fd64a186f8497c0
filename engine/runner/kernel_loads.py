"""Triton kernel variants compiled or loaded from the disk cache while the engine runs, logged with their seconds.

Triton builds a kernel per variant (the sizes it specialises on, the tile configuration chosen): the first launch of
a variant compiles it, or loads it from the disk cache, on the step that meets it.  A cold start's or a restart's
first steps stalled for seconds on such loads while nothing named them; this logs each one that took longer than
SLOW_S (`kernel_compiled`: the kernel, the seconds, whether the engine was serving), so that a slow first step says
which variant a warm-up should have met.  Triton without the runtime hooks (before 3.4) logs nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import structlog

log = structlog.get_logger("pagekeeper.engine")

SLOW_S = 0.05
_local = threading.local()
_installed = False
serving = threading.Event()  # set by the engine once it serves: loads after that held a request's step


def watch_kernel_loads() -> bool:
    """Install the hooks once per process (True when Triton has them)."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
        return False
    before: Callable[..., Any] | None = runtime.jit_cache_hook
    after: Callable[..., Any] | None = runtime.jit_post_compile_hook

    def cache_hook(**kw: Any) -> Any:
        starts = getattr(_local, "starts", None)
        if starts is None:
            starts = _local.starts = {}
        starts[(kw["fn"].name, kw["key"])] = time.monotonic()
        return before(**kw) if before is not None else None  # True would skip the compile: the chained hook's say

    def post_compile_hook(**kw: Any) -> Any:
        started = getattr(_local, "starts", {}).pop((kw["fn"].name, kw["key"]), None)
        if started is not None:
            spent = time.monotonic() - started
            if spent >= SLOW_S:
                log.info(
                    "kernel_compiled",
                    kernel=kw["fn"].name,
                    seconds=round(spent, 3),
                    serving=serving.is_set(),
                    warmup=bool(kw.get("is_manual_warmup")),
                )
        return after(**kw) if after is not None else None

    runtime.jit_cache_hook = cache_hook
    runtime.jit_post_compile_hook = post_compile_hook
    _installed = True
    return True
