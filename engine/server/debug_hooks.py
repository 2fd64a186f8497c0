"""Fault injection for tests (`--enable-debug-hooks`): nothing here exists in a server without the flag.

The hooks are installed, not polled: the step loop gets a hook that can hold it (a hang), and
/metrics gets a middleware that can answer garbage or slowly (a broken scrape target).  Without the
flag the routes are not mounted (404) and neither the step loop nor /metrics has an extra branch.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Awaitable, Callable

import structlog
from fastapi import APIRouter, Depends, FastAPI, Query, Request

from engine.kv.leak import KVLeak
from engine.server.errors import OpenAIError
from engine.server.state import ServerState, require_admin

log = structlog.get_logger("pagekeeper.server")

router = APIRouter(dependencies=[Depends(require_admin)], include_in_schema=False)

_GARBAGE = b"this is {not prometheus text\nvllm_num_requests_running{{{ 1\n"


class DebugHooks:
    def __init__(self, kv: Any = None, core_fault: Callable[..., None] | None = None) -> None:
        self._frozen = threading.Event()
        self._freeze_until = 0.0
        self.metrics_mode = "normal"
        self.metrics_seconds = 0.0
        self._leak = KVLeak(kv) if kv is not None else None  # a core in this process
        self.core_fault = core_fault  # a core in its own process (engine/loop/remote.py): told by message

    @property
    def leaked(self) -> int:
        return self._leak.leaked if self._leak is not None else 0

    def leak(self, blocks: int, leave: int) -> None:
        if self._leak is not None:
            self._leak.start(blocks, leave)
        elif self.core_fault is not None:
            self.core_fault("leak", blocks=blocks, leave=leave)

    def leak_blocks(self) -> None:
        """A step-loop hook (engine/kv/leak.py)."""
        if self._leak is not None:
            self._leak.step()

    def freeze(self, seconds: float) -> None:
        self._freeze_until = time.monotonic() + seconds
        self._frozen.set()
        log.warning("step_loop_frozen", seconds=seconds)

    def hold_step_loop(self) -> None:
        """A step-loop hook: sleep (holding no lock) while a freeze lasts."""
        if not self._frozen.is_set():
            return
        while time.monotonic() < self._freeze_until:
            time.sleep(0.05)
        self._frozen.clear()


def _hooks(http: Request) -> DebugHooks:
    hooks: DebugHooks = http.app.state.debug_hooks
    return hooks


@router.post("/debug/freeze")
async def freeze(http: Request, seconds: float = Query(..., gt=0.0, le=3600.0)) -> dict[str, float]:
    """Stop the step loop for `seconds` (hang detection)."""
    _hooks(http).freeze(seconds)
    return {"frozen_seconds": seconds}


@router.post("/debug/leak-kv")
async def leak_kv(
    http: Request,
    blocks: int = Query(..., ge=1, le=10_000_000),
    leave: int = Query(0, ge=0, le=10_000_000),
) -> dict[str, int]:
    """Leak up to `blocks` KV blocks, leaving `leave` free (the stuck-cache cure's fault)."""
    _hooks(http).leak(blocks, leave)
    return {"leak_blocks": blocks, "leave": leave}


@router.post("/debug/core-fault")
async def core_fault(http: Request, kind: str = Query(..., pattern="^(exit|fatal)$")) -> dict[str, str]:
    """Kill the engine core process at once ("exit", as kill -9 would) or make its next step raise as a fatal
    device error does ("fatal"); only where the core runs in its own process (engine/loop/)."""
    hooks = _hooks(http)
    if hooks.core_fault is None:
        raise OpenAIError(400, "the engine core runs in the server process here (--engine-core thread)", param="kind")
    hooks.core_fault(kind)
    return {"fault": kind}


@router.post("/debug/block-http-loop")
async def block_http_loop(seconds: float = Query(..., gt=0.0, le=60.0)) -> dict[str, float]:
    """Hold the HTTP event loop for `seconds`, as a CPU-starved host would, so that connections and
    signals pile up and are handled in the same loop iteration."""
    time.sleep(seconds)  # deliberately blocking
    return {"blocked_seconds": seconds}


@router.post("/debug/metrics")
async def debug_metrics(
    http: Request,
    mode: str = Query(..., pattern="^(normal|garbage|slow)$"),
    seconds: float = Query(5.0, ge=0.0, le=600.0),
) -> dict[str, Any]:
    """Make /metrics answer garbage, or slowly (tests of its scrapers)."""
    hooks = _hooks(http)
    hooks.metrics_mode, hooks.metrics_seconds = mode, seconds
    return {"mode": mode, "seconds": seconds}


class _MetricsFaults:
    """ASGI middleware in front of /metrics that applies the mode /debug/metrics set."""

    def __init__(self, app: Any, hooks: DebugHooks) -> None:
        self.app = app
        self.hooks = hooks

    async def __call__(
        self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]
    ) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            if self.hooks.metrics_mode == "garbage":
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
                    }
                )
                await send({"type": "http.response.body", "body": _GARBAGE})
                return
            if self.hooks.metrics_mode == "slow":
                await asyncio.sleep(self.hooks.metrics_seconds)
        await self.app(scope, receive, send)


def install(app: FastAPI, state: ServerState) -> DebugHooks:
    core = state.engine.core
    remote = getattr(core, "fault", None)  # a core in its own process is told by message (engine/loop/)
    hooks = DebugHooks(getattr(core, "kv", None) if remote is None else None, remote)  # kv: EngineCore's own
    app.state.debug_hooks = hooks
    state.async_engine.add_loop_hook(hooks.hold_step_loop)
    state.async_engine.add_loop_hook(hooks.leak_blocks)
    app.include_router(router)
    app.add_middleware(_MetricsFaults, hooks=hooks)
    log.warning(
        "debug_hooks_enabled",
        routes=["/debug/freeze", "/debug/block-http-loop", "/debug/metrics", "/debug/leak-kv", "/debug/core-fault"],
    )
    return hooks
