"""OpenAI request and response shapes (pydantic).

Bounds live in the schema so that an out-of-range value is refused by validation, with the field
named, before it reaches the engine; they also make the OpenAPI spec precise enough for schemathesis
to probe every edge.

No field is ever ignored.  An unknown field is a 400 naming it (`extra="forbid"`; a near miss such as
`max_token` is answered "did you mean 'max_tokens'?"): a client that asks for something we do not do must
hear so, not get an answer computed without it.  OpenAI's and vLLM's fields that pagekeeper does not
implement yet are declared (`NOT_YET`) and accepted only at the value that means "off", which clients send
as defaults; any other value is a 400 that names the field.

Every field is strictly typed, as OpenAI's API is: a JSON value of another type is a 400, never converted.
vLLM's models are lax pydantic, which converts `"max_tokens": "10"` to 10, `true` to 1, `2.0` to 2 and
`"stream": "yes"` to true; pagekeeper refuses those (a quoted number, a boolean for a number, a number with a
decimal point for an integer, a string or number for a boolean).  A float field takes an integer (`"temperature":
1`), and no number field takes NaN or infinity.  `model` may be left out: the served model answers, as in vLLM.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

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
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# Fields of OpenAI's and vLLM's request schemas that pagekeeper does not implement yet: the values that
# mean "off" (accepted) and what to say otherwise.  Typed Any in the schemas so that any value reaches
# this check and its message, instead of a type error about a feature we do not have.
_FEATURE = "is not supported yet"
NOT_YET: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), _FEATURE + " (only best_of 1 or equal to n)"),
    "use_beam_search": ((None, False), _FEATURE),
    "length_penalty": ((None, 1, 1.0), _FEATURE),
    # OpenAI's deprecated spellings of tools / tool_choice
    "functions": ((None, []), _FEATURE + " (the deprecated functions API: send tools)"),
    "function_call": ((None, "none"), _FEATURE + " (the deprecated functions API: send tool_choice)"),
    "suffix": ((None, ""), _FEATURE),
}


def not_yet_supported(body: BaseModel) -> tuple[str, str] | None:
    """(field, message) for the first field set to a value pagekeeper would have to ignore."""
    for name, (off, what) in NOT_YET.items():
        value = getattr(body, name, None)
        if _is_off(value, off):
            continue
        if name == "best_of" and _is_off(value, (getattr(body, "n", 1),)):
            continue  # best_of == n: every candidate is returned, nothing to choose
        return name, f"{name} {what}; leave it out or send {off[-1]!r}"
    return None


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    """`value` equals one of `off`, a bool never passing for 0/1 nor a number for a bool."""
    for v in off:
        if value is None or v is None:
            if value is v:
                return True
            continue
        if isinstance(value, bool) != isinstance(v, bool):
            continue
        numbers = isinstance(value, (int, float)) and isinstance(v, (int, float))
        if (numbers or type(value) is type(v)) and value == v:
            return True
    return False


class StreamOptions(_Request):
    include_usage: bool = False


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` field: exactly one constraint (engine/structured_output.py)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, max_length=100_000)
    choice: list[Annotated[str, Field(min_length=1, max_length=10_000)]] | None = Field(default=None, max_length=1024)
    grammar: str | None = Field(default=None, max_length=1_000_000)
    json_object: bool | None = None


class JsonSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(default=None, min_length=1, max_length=512, description="default: the served model")
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
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0**16, description="vLLM extension")
    min_tokens: int | None = Field(default=None, ge=0, lt=2**31, description="vLLM extension")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="vLLM extension")
    # OpenAI's JSON spells token ids as strings; values are added to the logits (clamped range [-100, 100])
    logit_bias: dict[str, float] | None = Field(default=None, max_length=2048)
    allowed_token_ids: list[NonNegInt] | None = Field(
        default=None, min_length=1, max_length=1_000_000, description="vLLM extension"
    )
    user: str | None = Field(
        default=None,
        max_length=256,
        description="logged with the request id (request_user), unless --disable-log-requests",
    )
    skip_special_tokens: bool = Field(default=True, description="vLLM extension")
    include_stop_str_in_output: bool = Field(default=False, description="vLLM extension")
    # structured outputs, vLLM's spellings (one of them per request)
    guided_json: dict[str, Any] | str | None = Field(default=None, description="vLLM extension: a JSON schema")
    guided_regex: str | None = Field(default=None, max_length=100_000, description="vLLM extension")
    guided_choice: list[Annotated[str, Field(min_length=1, max_length=10_000)]] | None = Field(
        default=None, min_length=1, max_length=1024, description="vLLM extension"
    )
    guided_grammar: str | None = Field(default=None, max_length=1_000_000, description="vLLM extension: Lark or GBNF")
    structured_outputs: StructuredOutputs | None = Field(default=None, description="vLLM extension")
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="vLLM extension: top-k logprobs at every prompt position"
    )
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=1, lt=2**31, description="vLLM extension: keep only the prompt's last k tokens"
    )
    bad_words: list[Annotated[str, Field(min_length=1, max_length=1000)]] | None = Field(
        default=None, max_length=1024, description="vLLM extension: words never generated"
    )
    # not implemented yet: accepted only when off (see NOT_YET)
    best_of: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None


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
    suffix: Any = None  # not implemented yet (see NOT_YET)


class TextPart(_Request):
    type: Literal["text"]
    text: str = Field(max_length=1_000_000)


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionCallParam(_Request):
    name: FunctionName
    arguments: str = Field(max_length=1_000_000, description="JSON text, as the model produced it")


class ToolCallParam(_Request):
    """A tool call of an earlier assistant turn, passed back in the conversation."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[Annotated[str, Field(max_length=1_000_000)], list[TextPart], None] = None
    name: str | None = Field(default=None, max_length=256, description="passed to the chat template")
    tool_calls: list[ToolCallParam] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = Field(default=None, max_length=256, description="the call a tool message answers")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Request):
    name: FunctionName
    description: str | None = Field(default=None, max_length=100_000)
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON schema of the arguments object")
    strict: bool | None = Field(default=None, description="the arguments always follow the schema (they do here)")


class ToolParam(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(default=None, ge=1, lt=2**31)
    max_completion_tokens: int | None = Field(default=None, ge=1, lt=2**31)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = Field(default=True, description="vLLM extension")
    response_format: ResponseFormat | None = None
    tools: list[ToolParam] | None = Field(default=None, max_length=128)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        default=None, description='"auto" when tools are given, else "none" (as OpenAI)'
    )
    parallel_tool_calls: bool | None = Field(
        default=None, description="false: at most one tool call (with tool_choice required)"
    )
    # not implemented yet: accepted only when off (see NOT_YET)
    functions: Any = None
    function_call: Any = None


class TokenizeRequest(_Request):
    model: str | None = Field(default=None, max_length=512)
    prompt: str | None = Field(default=None, max_length=1_000_000)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=1024)
    tools: list[ToolParam] | None = Field(default=None, max_length=128, description="shown to the chat template")
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


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt position (None for the first), {token id: its logprob}
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text of an object


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = []


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
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first carries id, type and name; later ones more arguments text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
