"""What the route handlers share: the engine, its async bridge, metrics, and tokenizer helpers.

Tokenization happens in the handlers (before a request is admitted), detokenization of whole
outputs in the engine thread; these helpers are the one place handlers touch the tokenizer.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import structlog
from fastapi import Request

from engine.chat import ChatTemplateError, render_chat
from engine.core.admission import ValidRequest
from engine.loop.async_engine import AsyncEngine, EngineDraining, EngineOverloaded
from engine.loop.llm_engine import LLMEngine
from engine.server.errors import OpenAIError
from engine.server.metrics import EngineMetrics

log = structlog.get_logger("pagekeeper.server")

CHARS_PER_TOKEN_BOUND = 32


@dataclass
class ServerState:
    engine: LLMEngine
    async_engine: AsyncEngine
    metrics: EngineMetrics
    model_name: str
    model_root: str
    api_key: str | None = None
    admin_key: str | None = None
    enable_debug_hooks: bool = False
    log_requests: bool = True
    chat_template: str | None = None  # --chat-template (its text), else the model's
    tool_call_parser: str | None = None  # --tool-call-parser
    enable_auto_tool_choice: bool = False
    retry_after_seconds: int = 1
    started_at: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.tokenizer = self.engine.tokenizer
        # No token of a real vocabulary spans this many characters: a longer prompt cannot fit max_model_len,
        # and is refused before minutes of tokenizing.
        self.max_prompt_chars = self.engine.max_model_len * CHARS_PER_TOKEN_BOUND
        # One thread tokenizes, off the event loop (health checks and streams go on meanwhile) and one call at
        # a time (a fast tokenizer's settings are not safe to change from two threads at once).
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.vocab_size = self.engine.limits.vocab_size
        self.model_names = {self.model_name, self.model_root}
        self.decode_token = lru_cache(maxsize=65536)(self._decode_one)

    def check_length(self, text: str, param: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise OpenAIError(
                400,
                f"{param} has {len(text)} characters; at most {self.max_prompt_chars} can fit "
                f"max_model_len {self.engine.max_model_len}",
                param=param,
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_length(text, "prompt")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def off_loop(self, fn: Any, *args: Any) -> Any:
        """Run a tokenizer call on the tokenizing thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def apply_chat_template(
        self, messages: list[Any], add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        for i, m in enumerate(messages):
            self.check_length(m.text(), f"messages[{i}].content")
        try:
            text = render_chat(
                self.tokenizer,
                [m.model_dump(exclude_none=True) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                chat_template=self.chat_template,
            )
        except ChatTemplateError as e:
            raise OpenAIError(400, f"{e} (model {self.model_name!r})", param="messages") from e
        return self.encode(text, add_special_tokens=False)

    def admit(self, request_id: str, request: ValidRequest, stream: bool) -> Any:
        """Admit into the engine, turning a refusal into 503 (draining) or 429 (queue full)."""
        retry = {"Retry-After": str(self.retry_after_seconds)}
        try:
            return self.async_engine.admit(request_id, request, stream)
        except EngineDraining as e:
            self.metrics.request_failed("rejected")
            raise OpenAIError(503, str(e), code="draining", headers=retry) from e
        except EngineOverloaded as e:
            self.metrics.request_failed("rejected")
            raise OpenAIError(429, str(e), code="overloaded", headers=retry) from e


def get_state(request: Request) -> ServerState:
    return request.app.state.pk


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


async def require_api_key(request: Request) -> None:
    """Bearer auth on /v1/* and /tokenize when --api-key is set (constant-time comparison)."""
    key = get_state(request).api_key
    if key and not _matches(_bearer(request), key):
        raise OpenAIError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def is_loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    return host in ("::1", "localhost") or host.startswith("127.") or host.startswith("::ffff:127.")


async def require_admin(request: Request) -> None:
    """Admin routes: anyone with the admin key; loopback clients too, unless an API key is set.

    With an API key the operator has said that not every local process is trusted, so a drain from
    loopback needs the admin key as well (restarts do not use /drain: the supervisor talks to its engine
    over a private unix socket).  Every drain or resume is logged with who asked.
    """
    state = get_state(request)
    key = state.admin_key
    client = request.client.host if request.client else "?"
    if key and _matches(_bearer(request), key):
        log.info("admin_request", path=request.url.path, method=request.method, client=client, auth="admin_key")
        return
    if is_loopback(request) and not state.api_key:
        log.info("admin_request", path=request.url.path, method=request.method, client=client, auth="loopback")
        return
    log.warning("admin_request_refused", path=request.url.path, method=request.method, client=client)
    if state.api_key:
        raise OpenAIError(
            401,
            "with --api-key set, admin endpoints need 'Authorization: Bearer <admin key>' "
            "(--admin-key / PAGEKEEPER_ADMIN_KEY), from loopback too",
            code="invalid_admin_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    raise OpenAIError(
        403,
        "admin endpoints accept loopback clients or 'Authorization: Bearer <admin key>' "
        "(--admin-key / PAGEKEEPER_ADMIN_KEY)",
        code="forbidden",
    )
