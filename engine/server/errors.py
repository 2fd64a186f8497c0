"""OpenAI's error shape for every failure: {"error": {"message", "type", "param", "code"}}.

Validation errors name the offending field (as `param`), so a client can fix its request without
reading server logs.  Only a bug in the engine produces a 5xx.
"""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.server.async_engine import EngineStopping
from engine.server.protocol import ErrorResponse

log = structlog.get_logger("pagekeeper.server")

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "BadRequestError",
    413: "BadRequestError",
    422: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "BadRequestError")
        self.param = param
        self.code = code if code is not None else status
        self.headers = headers


def error_body(
    status: int, message: str, type: str | None = None, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type or _TYPES.get(status, "BadRequestError"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI documentation of the error responses a route can give."""
    return {s: {"model": ErrorResponse, "description": _TYPES.get(s, "error")} for s in statuses}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "json-or-python", "tagged-union"})


def _param(loc: tuple[Any, ...]) -> str:
    parts = [str(x) for x in loc if x not in ("body", "query", "path", "header")]
    # pydantic adds the union member's type to the location; keep only field names and indices
    # (exact type tags: a prefix test would drop fields such as structured_outputs or stream_options)
    kept = [
        x
        for x in parts
        if not any(c in x for c in "[]'") and x not in _TYPE_TAGS and not x.startswith(("function-", "constrained-"))
    ]
    return ".".join(kept) or "body"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(error_body(e.status, e.message, e.type, e.param, e.code), e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = _param(tuple(first.get("loc", ())))
        msg = str(first.get("msg", "invalid value"))
        if first.get("type") == "json_invalid":
            param, msg = "body", f"the body is not valid JSON: {msg}"
        extra = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        return JSONResponse(error_body(400, f"{param}: {msg}{extra}", param=param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(e.status_code, str(e.detail)), e.status_code, headers=e.headers)

    @app.exception_handler(EngineStopping)
    async def _stopping(_: Request, e: EngineStopping) -> JSONResponse:
        return JSONResponse(error_body(503, str(e), code="engine_restarting"), 503, headers={"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        log.exception("request_failed", error=str(e))
        return JSONResponse(error_body(500, f"internal error: {e}"), 500)
