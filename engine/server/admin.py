"""Operational routes: /health that sees a hung step loop, /metrics, /drain, /version.

/health is what load balancers and the supervisor trust, so it reports the step loop's real state:
200 only while the loop is idle or advancing; 503 "draining" while draining; 503 "stalled" when
work is waiting and the loop has not stepped within --health-stall-seconds.
"""

from __future__ import annotations

import asyncio
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.server.errors import OpenAIError, error_responses
from engine.server.state import get_state, require_admin

router = APIRouter()


def package_version() -> str:
    try:
        return version("pagekeeper")
    except PackageNotFoundError:
        return "0+unknown"


@router.get("/health", responses={503: {"description": "draining or stalled"}})
async def health(http: Request) -> JSONResponse:
    status = get_state(http).async_engine.health()
    return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)


@router.get("/metrics", response_class=Response)
async def metrics(http: Request) -> Response:
    state = get_state(http)
    mode, seconds = state.debug_metrics_mode
    if mode == "garbage":
        return Response(b"this is {not prometheus text\nvllm_num_requests_running{{{ 1\n", media_type=CONTENT_TYPE_LATEST)
    if mode == "slow":
        await asyncio.sleep(seconds)
    # Running, waiting and cache usage come from one snapshot the step loop takes after each step, so
    # that they agree with each other (a live queue next to the last step's batch reads as a backlog
    # that is not there).  Only a stalled loop, which refreshes nothing, has its queue read live:
    # requests piling up behind it are exactly what an operator needs to see.
    if state.async_engine.health() == "stalled":
        state.metrics.waiting.labels(state.model_name).set(state.async_engine.queue_depth())
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version_info() -> dict[str, str]:
    return {"version": package_version()}


@router.post("/drain", dependencies=[Depends(require_admin)], responses=error_responses(403))
async def drain(http: Request, timeout: float = Query(60.0, ge=0.0, le=86400.0)) -> dict[str, Any]:
    """Stop admitting; wait until in-flight requests finish or `timeout` seconds pass."""
    result = await get_state(http).async_engine.drain(timeout)
    return result.__dict__


@router.delete("/drain", dependencies=[Depends(require_admin)], responses=error_responses(403))
async def undrain(http: Request) -> dict[str, str]:
    """Admit requests again after a drain that was not followed by a restart."""
    get_state(http).async_engine.resume()
    return {"status": "ok"}


@router.post("/debug/freeze", dependencies=[Depends(require_admin)], include_in_schema=False)
async def freeze(http: Request, seconds: float = Query(..., gt=0.0, le=3600.0)) -> dict[str, float]:
    """Test hook (--enable-debug-hooks): stop the step loop for `seconds` to exercise hang detection."""
    state = get_state(http)
    if not state.enable_debug_hooks:
        raise OpenAIError(404, "Not Found")
    state.async_engine.freeze(seconds)
    return {"frozen_seconds": seconds}


@router.post("/debug/block-http-loop", dependencies=[Depends(require_admin)], include_in_schema=False)
async def block_http_loop(http: Request, seconds: float = Query(..., gt=0.0, le=60.0)) -> dict[str, float]:
    """Test hook (--enable-debug-hooks): hold the HTTP event loop for `seconds`, as a CPU-starved host
    would, so that connections and signals pile up and are handled in the same loop iteration."""
    state = get_state(http)
    if not state.enable_debug_hooks:
        raise OpenAIError(404, "Not Found")
    time.sleep(seconds)  # deliberately blocking
    return {"blocked_seconds": seconds}


@router.post("/debug/metrics", dependencies=[Depends(require_admin)], include_in_schema=False)
async def debug_metrics(http: Request, mode: str = Query(..., pattern="^(normal|garbage|slow)$"),
                        seconds: float = Query(5.0, ge=0.0, le=600.0)) -> dict[str, Any]:
    """Test hook (--enable-debug-hooks): make /metrics answer garbage, or slowly, to test its scrapers."""
    state = get_state(http)
    if not state.enable_debug_hooks:
        raise OpenAIError(404, "Not Found")
    state.debug_metrics_mode = (mode, seconds)
    return {"mode": mode, "seconds": seconds}
