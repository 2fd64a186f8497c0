"""OpenAI's error shape for every failure: {"error": {"message", "type", "param", "code"}}.

Validation errors name the offending field (as `param`), so a client can fix its request without
reading server logs.  Only a bug in the engine produces a 5xx.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.loop.async_engine import EngineStopping
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


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation holds (inside Optional, Union, list, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _field_names(model: type[BaseModel]) -> dict[str, Any]:
    """{name or alias: annotation} of a model's fields."""
    names: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        names[name] = info.annotation
        if info.alias:
            names[info.alias] = info.annotation
    return names


def near_miss(request: Request, loc: tuple[Any, ...]) -> str | None:
    """The declared field an unknown one was probably meant to be (`max_token`: `max_tokens`), or None.

    The route's body model is followed along the error's location (nested objects, list items, union members)
    to the object that holds the unknown key; its own field names are the candidates."""
    endpoint = getattr(request.scope.get("route"), "endpoint", None)
    try:
        hints = typing.get_type_hints(endpoint) if endpoint is not None else {}
    except (NameError, TypeError):
        return None
    models = _models_in(hints.get("body"))
    parts = [x for x in loc if x != "body"]
    if not models or not parts:
        return None
    model = models[0]
    for part in parts[:-1]:
        fields = _field_names(model)
        if isinstance(part, str) and part in fields:
            inner = _models_in(fields[part])
            if not inner:
                return None
            model = next((m for m in inner if m.__name__ in map(str, parts)), inner[0])
    match = difflib.get_close_matches(str(parts[-1]), list(_field_names(model)), n=1, cutoff=0.7)
    return match[0] if match else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(error_body(e.status, e.message, e.type, e.param, e.code), e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        meant = None
        for error in errors:  # a misspelt field is the cause of the "missing" error its right spelling gets
            if error.get("type") == "extra_forbidden":
                meant = near_miss(request, tuple(error.get("loc", ())))
                if meant is not None:
                    first = error
                    break
        param = _param(tuple(first.get("loc", ())))
        msg = str(first.get("msg", "invalid value"))
        if first.get("type") == "json_invalid":
            param, msg = "body", f"the body is not valid JSON: {msg}"
        elif first.get("type") == "extra_forbidden":
            msg = "unknown field" + (f"; did you mean {meant!r}?" if meant else "")
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
