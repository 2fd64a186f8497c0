"""OpenAI request and response shapes (pydantic).

Bounds live in the schema so that an out-of-range value is refused by validation, with the field
named, before it reaches the engine; they also make the OpenAPI spec precise enough for schemathesis
to probe every edge.  Unknown fields are ignored, as OpenAI's own clients send optional extras.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16
MAX_STOP = 16
MAX_LOGPROBS = 20
MAX_PROMPTS = 64

NonNegInt = Annotated[int, Field(ge=0, lt=2**31)]
TokenIds = Annotated[list[NonNegInt], Field(min_length=1)]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str = Field(min_length=1, max_length=512)
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000, description="vLLM extension; -1 or 0 disables")
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: Union[
        Annotated[str, Field(max_length=256)],
        Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=MAX_STOP)],
        None,
    ] = None
    stop_token_ids: list[NonNegInt] | None = Field(default=None, max_length=MAX_STOP, description="vLLM extension")
    ignore_eos: bool = Field(default=False, description="vLLM extension")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="only 0 is supported")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="only 0 is supported")
    user: str | None = Field(default=None, max_length=256)


class CompletionRequest(_SamplingFields):
    prompt: Union[
        Annotated[str, Field(max_length=1_000_000)],
        Annotated[list[Annotated[str, Field(max_length=1_000_000)]], Field(min_length=1, max_length=MAX_PROMPTS)],
        TokenIds,
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)],
    ]
    max_tokens: int | None = Field(default=16, ge=1, lt=2**31)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class TextPart(_Request):
    type: Literal["text"]
    text: str = Field(max_length=1_000_000)


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[Annotated[str, Field(max_length=1_000_000)], list[TextPart], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(default=None, ge=1, lt=2**31)
    max_completion_tokens: int | None = Field(default=None, ge=1, lt=2**31)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = Field(default=True, description="vLLM extension")


class TokenizeRequest(_Request):
    model: str | None = Field(default=None, max_length=512)
    prompt: str | None = Field(default=None, max_length=1_000_000)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=1024)
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: str | None = Field(default=None, max_length=512)
    tokens: list[NonNegInt] = Field(max_length=1_000_000)


# -- responses --------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagekeeper"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
