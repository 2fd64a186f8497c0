"""Operational routes: /health that sees a hung step loop, /metrics, /drain, /recycle, /version.

/health is what load balancers and the supervisor trust, so it reports the step loop's real state:
200 only while the loop is idle or advancing; 503 "draining" while draining; 503 "stalled" when
work is waiting and the loop has not stepped within --health-stall-seconds.
"""

from __future__ import annotations

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
    # Running, waiting and cache usage come from one snapshot the step loop takes after each step, so
    # that they agree with each other (a live queue next to the last step's batch reads as a backlog
    # that is not there).  Only a stalled loop, which refreshes nothing, has its queue read live:
    # requests piling up behind it are exactly what an operator needs to see.
    if state.async_engine.health() == "stalled":
        state.metrics.set_live_waiting(state.async_engine.queue_depth())
    # `name[]=<sample name>` (repeatable) keeps only those series, as Prometheus' own client libraries do
    return Response(state.metrics.render(http.query_params.getlist("name[]")), media_type=CONTENT_TYPE_LATEST)


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


@router.post("/recycle", dependencies=[Depends(require_admin)], responses=error_responses(403, 409))
async def recycle(http: Request) -> JSONResponse:
    """Rebuild the KV pool and the prefix cache in place, between two steps: running requests are requeued and
    recomputed (none is lost).  The supervisor's cure for a pool that stays full (engine/core/engine_core.py)."""
    import asyncio

    try:
        future = get_state(http).async_engine.recycle()
    except ValueError as e:
        raise OpenAIError(409, str(e), code="not_serving") from None
    report = await asyncio.wrap_future(future)
    return JSONResponse({"ok": True, **report})
