"""The FastAPI application: routers, error handlers, request logging."""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

import structlog
from fastapi import FastAPI

from engine.server import admin, openai_api
from engine.server.errors import install_error_handlers
from engine.server.state import ServerState

log = structlog.get_logger("pagekeeper.server")

_QUIET_PATHS = ("/health", "/metrics")


class RequestLog:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which hides client disconnects from routes).

    Logs method, path, status and duration: never bodies, so prompts stay out of the logs.  A request whose body
    never arrived whole (its connection closed first: a client killed mid-send, connections closed at shutdown)
    is not a request the server got: it is logged at debug level as `http_request_unread`, not as an
    `http_request` with the 400 that FastAPI answers a body it could not read (nobody receives that answer).
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(
        self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http" or scope["path"] in _QUIET_PATHS:
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 0
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"")
        body_read = not ((length.isdigit() and int(length) > 0) or b"transfer-encoding" in headers)

        async def send_and_note(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        async def receive_and_note() -> dict:
            nonlocal body_read
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body"):
                body_read = True
            return message

        try:
            await self.app(scope, receive_and_note, send_and_note)
        finally:
            fields = {"method": scope["method"], "path": scope["path"], "seconds": round(time.monotonic() - start, 4)}
            if body_read:
                log.info("http_request", status=status, **fields)
            else:
                log.debug("http_request_unread", **fields)


def _openapi_with_model_names(app: FastAPI, names: list[str]) -> Callable[[], dict[str, Any]]:
    """The spec names the served models as an enum, so generated clients and fuzzers use real ones."""
    from fastapi.openapi.utils import get_openapi

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for schema in spec.get("components", {}).get("schemas", {}).values():
                prop = schema.get("properties", {}).get("model")
                if prop is None:
                    continue
                enum = {"type": "string", "enum": names}
                if "anyOf" in prop:
                    prop["anyOf"] = [enum if v.get("type") == "string" else v for v in prop["anyOf"]]
                else:
                    prop.update(enum)
                    prop.pop("minLength", None)
                    prop.pop("maxLength", None)
            app.openapi_schema = spec
        return app.openapi_schema

    return build


def build_app(state: ServerState, docs: bool = True) -> FastAPI:
    """`docs` False (--disable-fastapi-docs): no /docs, /redoc or /openapi.json, which answer without the API key."""
    app = FastAPI(
        title="pagekeeper",
        version=admin.package_version(),
        description="OpenAI-compatible LLM server with PagedAttention",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.pk = state
    app.include_router(openai_api.router)
    app.include_router(admin.router)
    install_error_handlers(app)
    # the served name only: the checkpoint's path on the server's disk is nobody's business
    app.openapi = _openapi_with_model_names(app, [state.model_name])  # type: ignore[method-assign]
    if state.enable_debug_hooks:
        from engine.server import debug_hooks

        debug_hooks.install(app, state)
    if state.log_requests:
        app.add_middleware(RequestLog)
    return app
