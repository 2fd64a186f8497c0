"""OpenAI-compatible routes: completions, chat completions (both streaming), models, tokenize.

Every request is checked completely (model name, parameters, prompt length against
max_model_len and the KV pool, admission) before anything is queued, so a request that gets a 200
status line is one the engine has accepted and will finish.  Streams hold back the tail of the text
that could still turn into a stop string, so a client never sees text that is later cut.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

import structlog
from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from engine.loop.async_engine import EngineStepError, EngineStopping
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from engine.server import protocol as p
from engine.server.errors import OpenAIError, error_body, error_responses
from engine.server.state import ServerState, get_state, require_api_key
from engine.server.tool_calls import ToolCallStream, finish_reason, parse_reply, plan_tools

log = structlog.get_logger("pagekeeper.server")

router = APIRouter(dependencies=[Depends(require_api_key)], responses=error_responses(400, 401, 404, 429, 503))

_DISCONNECT_POLL_S = 0.25


@dataclass
class _Prompt:
    text: str | None
    ids: list[int]


# -- shared plumbing --------------------------------------------------------------------------


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_names:
        raise OpenAIError(
            404,
            f"the model {model!r} does not exist; this server serves {state.model_name!r}",
            "NotFoundError",
            "model",
            "model_not_found",
        )


def _sampling_params(
    state: ServerState,
    body: p._SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    tool_constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    refused = p.not_yet_supported(body)
    if refused is not None:
        raise OpenAIError(400, refused[1], param=refused[0])
    defaults = state.engine.generation_defaults  # --generation-config: what fields left out default to

    def given(value: Any, name: str, fallback: Any) -> Any:
        return defaults.get(name, fallback) if value is None else value

    try:
        return SamplingParams(
            n=body.n,
            temperature=given(body.temperature, "temperature", 1.0),
            top_p=given(body.top_p, "top_p", 1.0),
            top_k=given(body.top_k, "top_k", 0),
            seed=body.seed,
            max_tokens=max_tokens,  # None: what fits, or the checkpoint's max_new_tokens (LLMEngine.validate)
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=given(body.repetition_penalty, "repetition_penalty", 1.0),
            min_tokens=body.min_tokens or 0,
            min_p=given(body.min_p, "min_p", 0.0),
            logit_bias=_logit_bias(body.logit_bias),
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            structured_outputs=_structured_outputs(body, tool_constraint),
            prompt_logprobs=body.prompt_logprobs,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
        )
    except SamplingParamsError as e:
        raise OpenAIError(400, str(e), param=e.param) from e


def _structured_outputs(
    body: p._SamplingFields, tool_constraint: StructuredOutputsParams | None = None
) -> StructuredOutputsParams | None:
    """The one constraint the request asks for, from whichever of vLLM's and OpenAI's fields it used (a tool
    choice of required or a named function is one too)."""
    found: list[StructuredOutputsParams] = [tool_constraint] if tool_constraint is not None else []
    if body.guided_json is not None:
        found.append(StructuredOutputsParams(json=body.guided_json, param="guided_json"))
    if body.guided_regex is not None:
        found.append(StructuredOutputsParams(regex=body.guided_regex, param="guided_regex"))
    if body.guided_choice is not None:
        found.append(StructuredOutputsParams(choice=body.guided_choice, param="guided_choice"))
    if body.guided_grammar is not None:
        found.append(StructuredOutputsParams(grammar=body.guided_grammar, param="guided_grammar"))
    so = body.structured_outputs
    if so is not None:
        found.append(
            StructuredOutputsParams(
                json=so.json_,
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
                json_object=so.json_object,
                param="structured_outputs",
            )
        )
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(StructuredOutputsParams(json_object=True, param="response_format"))
        elif fmt.json_schema is None:
            raise OpenAIError(400, "response_format json_schema needs its json_schema object", param="response_format")
        else:
            found.append(StructuredOutputsParams(json=fmt.json_schema.schema_, param="response_format"))
    if len(found) > 1:
        raise OpenAIError(
            400,
            f"{found[1].param} and {found[0].param} both constrain the output; send one of them",
            param=found[1].param,
        )
    return found[0] if found else None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's {"token id as a string": bias}; a key that is not a token id is a 400."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0 or str(token) != key.strip():
            raise OpenAIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        out[token] = value
    return out


@dataclass
class _Admitted:
    request_id: str
    slot: Any


def _admit(
    state: ServerState,
    request_id: str,
    prompts: list[_Prompt],
    params: SamplingParams,
    stream: bool,
    user: str | None = None,
    prompt_param: str = "prompt",
) -> list[_Admitted]:
    """Refuse now (400/429/503) or accept every prompt of the request; nothing is half-admitted.
    This is the one place a served request is validated.  `prompt_param`: the request field the prompt came
    from (a chat's is `messages`), named when the prompt is what does not fit."""
    valid = []
    for i, prompt in enumerate(prompts):
        try:
            valid.append(state.engine.validate(prompt.ids, params, prompt.text))
        except SamplingParamsError as e:
            param = e.param
            if param == "prompt":
                param = prompt_param if len(prompts) == 1 else f"{prompt_param}[{i}]"
            state.metrics.request_failed("invalid")
            raise OpenAIError(400, str(e), param=param) from e
    admitted: list[_Admitted] = []
    try:
        for i, request in enumerate(valid):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            admitted.append(_Admitted(rid, state.admit(rid, request, stream)))
    except BaseException:
        for a in admitted:
            state.async_engine.release(a.request_id, a.slot)
        raise
    if user is not None and state.log_requests:
        # OpenAI's `user`: who the request is for, so that abuse can be traced to an end user
        log.info("request_user", request_id=request_id, user=user)
    return admitted


async def _final(state: ServerState, http: Request, admitted: _Admitted) -> RequestOutput:
    """Run an admitted request to the end, aborting it if the client goes away meanwhile."""

    async def collect() -> RequestOutput:
        last = None
        async for out in state.async_engine.results(admitted.request_id, admitted.slot):
            last = out
        assert last is not None
        return last

    task = asyncio.ensure_future(collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http.is_disconnected():
                task.cancel()
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()
        state.async_engine.release(admitted.request_id, admitted.slot)


async def _merged(state: ServerState, admitted: list[_Admitted]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several prompts' requests as they come, tagged with the prompt's index."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, a: _Admitted) -> None:
        try:
            async for out in state.async_engine.results(a.request_id, a.slot):
                await queue.put((i, out))
            await queue.put((i, None))
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, a)) for i, a in enumerate(admitted)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for a in admitted:
            state.async_engine.release(a.request_id, a.slot)


def _sse(data: Any) -> str:
    if isinstance(data, str):
        return f"data: {data}\n\n"
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _usage(finals: list[RequestOutput]) -> p.Usage:
    """Token counts from the requests' final outputs (which hold the counts, also after deltas)."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)  # after truncate_prompt_tokens
    completion = 0
    for o in finals:
        counts = o.metrics.output_token_counts if o.metrics is not None else []
        completion += sum(counts) if counts else sum(len(c.token_ids) for c in o.outputs)
    return p.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


async def _ending_cleanly(body: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream the engine fails (stopped without draining, a failed step) ends with an error event and
    [DONE], as vLLM's do, instead of being cut off mid-way: the client can tell an error from a network fault."""
    try:
        async for event in body:
            yield event
    except EngineStopping as e:
        yield _sse(error_body(503, str(e), code="engine_restarting"))
        yield _sse("[DONE]")
    except EngineStepError as e:
        yield _sse(error_body(500, str(e)))
        yield _sse("[DONE]")


def _streaming(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        _ending_cleanly(body),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class _Deltas:
    """Which choices of a stream have already been sent their finish."""

    def __init__(self) -> None:
        self.finished: set[int] = set()

    def take(self, index: int, c: CompletionOutput) -> tuple[str, list[int], bool]:
        """(new text, positions of the new tokens in `c`, just finished) for the choice at `index`;
        `c` is a delta, so it holds only what is new."""
        just_finished = c.finish_reason is not None and index not in self.finished
        if just_finished:
            self.finished.add(index)
        return c.text, list(range(len(c.token_ids))), just_finished


# -- /v1/completions ----------------------------------------------------------------------------


def _completion_prompts(state: ServerState, prompt: Any) -> list[_Prompt]:
    if isinstance(prompt, str):
        return [_Prompt(prompt, state.encode(prompt))]
    if prompt and isinstance(prompt[0], int):
        return [_Prompt(None, list(prompt))]
    if prompt and isinstance(prompt[0], str):
        return [_Prompt(s, state.encode(s)) for s in prompt]
    return [_Prompt(None, list(ids)) for ids in prompt]


def _completion_logprobs(
    state: ServerState, c: CompletionOutput, positions: list[int], offset: int
) -> p.CompletionLogprobs | None:
    if c.logprobs is None:
        return None
    lp = p.CompletionLogprobs()
    for pos in positions:
        tok = c.token_ids[pos]
        entry = c.logprobs[pos]
        piece = state.decode_token(tok)
        lp.tokens.append(piece)
        lp.token_logprobs.append(entry[tok].logprob)
        lp.top_logprobs.append({state.decode_token(t): v.logprob for t, v in entry.items()})
        lp.text_offset.append(offset)
        offset += len(piece)
    return lp


@router.post(
    "/v1/completions", response_model=p.CompletionResponse, responses={200: {"content": {"text/event-stream": {}}}}
)
async def completions(body: p.CompletionRequest, http: Request) -> Any:
    state = get_state(http)
    _check_model(state, body.model)
    scored_echo = body.echo and body.logprobs is not None  # the echoed prompt comes with its logprobs
    if body.stream and (scored_echo or body.prompt_logprobs is not None):
        param = "prompt_logprobs" if body.prompt_logprobs is not None else "echo"
        raise OpenAIError(
            400, f"{param} with logprobs needs stream false (prompt logprobs are not streamed)", param=param
        )
    if isinstance(body.prompt, str):
        state.check_length(body.prompt, "prompt")
    elif body.prompt and isinstance(body.prompt[0], str):
        for text in body.prompt:
            state.check_length(text, "prompt")
    prompts = await state.off_loop(_completion_prompts, state, body.prompt)
    keep = body.truncate_prompt_tokens
    if keep is not None:  # here too, so that echo returns what the model saw
        prompts = [_Prompt(None, pr.ids[-keep:]) if len(pr.ids) > keep else pr for pr in prompts]
    params = _sampling_params(state, body, body.max_tokens, body.logprobs)
    if scored_echo and params.prompt_logprobs is None:
        params.prompt_logprobs = body.logprobs
    request_id = p.new_id("cmpl")
    admitted = _admit(state, request_id, prompts, params, bool(body.stream), body.user)
    created = p.now()
    n = params.n

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            deltas = _Deltas()
            last: dict[int, RequestOutput] = {}
            if body.echo:
                for i, pr in enumerate(prompts):
                    text = pr.text if pr.text is not None else state.decode(pr.ids)
                    for j in range(n):
                        yield _sse(_completion_chunk(request_id, created, state, i * n + j, text, None, None))
            async for i, out in _merged(state, admitted):
                last[i] = out
                for c in out.outputs:
                    index = i * n + c.index
                    text, positions, finished = deltas.take(index, c)
                    if not text and not positions and not finished:
                        continue  # a chunk for every new token, even one with no text yet (a special
                        # token, half a UTF-8 character, a held-back stop-string prefix): its logprobs
                        # and its timing reach the client
                    lp = _completion_logprobs(state, c, positions, 0)
                    reason = c.finish_reason if finished else None
                    yield _sse(
                        _completion_chunk(
                            request_id, created, state, index, text, lp, reason, c.stop_reason if finished else None
                        )
                    )
            if include_usage:
                usage = _usage([last[i] for i in sorted(last)])
                yield _sse(
                    {
                        "id": request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": state.model_name,
                        "choices": [],
                        "usage": usage.model_dump(),
                    }
                )
            yield _sse("[DONE]")

        return _streaming(events())

    outputs = await asyncio.gather(*(_final(state, http, a) for a in admitted))
    choices = []
    for i, (pr, out) in enumerate(zip(prompts, outputs)):
        prefix = ""
        if body.echo:
            prefix = pr.text if pr.text is not None else state.decode(pr.ids)
        for c in out.outputs:
            logprobs = _completion_logprobs(state, c, list(range(len(c.token_ids))), len(prefix))
            if scored_echo and logprobs is not None:
                logprobs = _echo_logprobs(state, pr.ids, out.prompt_logprobs, logprobs)
            choices.append(
                p.CompletionChoice(
                    index=i * n + c.index,
                    text=prefix + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=_prompt_logprobs(state, out) if body.prompt_logprobs is not None else None,
                )
            )
    return p.CompletionResponse(
        id=request_id, created=created, model=state.model_name, choices=choices, usage=_usage(list(outputs))
    )


def _echo_logprobs(
    state: ServerState,
    ids: list[int],
    prompt: list[dict[int, Logprob] | None] | None,
    generated: p.CompletionLogprobs,
) -> p.CompletionLogprobs:
    """The echoed prompt's tokens and logprobs before the completion's (the first token has none)."""
    assert prompt is not None and len(prompt) == len(ids)
    lp = p.CompletionLogprobs()
    offset = 0
    for tok, entry in zip(ids, prompt):
        piece = state.decode_token(tok)
        lp.tokens.append(piece)
        lp.token_logprobs.append(None if entry is None else entry[tok].logprob)
        lp.top_logprobs.append(None if entry is None else {state.decode_token(t): v.logprob for t, v in entry.items()})
        lp.text_offset.append(offset)
        offset += len(piece)
    lp.tokens += generated.tokens
    lp.token_logprobs += generated.token_logprobs
    lp.top_logprobs += generated.top_logprobs
    lp.text_offset += generated.text_offset
    return lp


def _prompt_logprobs(state: ServerState, out: RequestOutput) -> p.PromptLogprobs | None:
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): p.PromptLogprob(logprob=v.logprob, rank=v.rank, decoded_token=state.decode_token(t))
            for t, v in entry.items()
        }
        for entry in out.prompt_logprobs
    ]


def _completion_chunk(
    request_id: str,
    created: int,
    state: ServerState,
    index: int,
    text: str,
    logprobs: p.CompletionLogprobs | None,
    finish_reason: str | None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    choice = p.CompletionChoice(
        index=index, text=text, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason
    )
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": state.model_name,
        "choices": [choice.model_dump()],
    }


# -- /v1/chat/completions -----------------------------------------------------------------------


def _chat_logprobs(state: ServerState, c: CompletionOutput, positions: list[int]) -> p.ChatLogprobs | None:
    if c.logprobs is None:
        return None
    entries = []
    for pos in positions:
        tok = c.token_ids[pos]
        entry = c.logprobs[pos]
        piece = state.decode_token(tok)
        top = [
            p.TopLogprob(token=state.decode_token(t), logprob=v.logprob, bytes=list(state.decode_token(t).encode()))
            for t, v in entry.items()
            if v.rank is not None
        ]
        entries.append(
            p.ChatLogprobEntry(token=piece, logprob=entry[tok].logprob, bytes=list(piece.encode()), top_logprobs=top)
        )
    return p.ChatLogprobs(content=entries)


@router.post(
    "/v1/chat/completions",
    response_model=p.ChatCompletionResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def chat_completions(body: p.ChatCompletionRequest, http: Request) -> Any:
    state = get_state(http)
    _check_model(state, body.model)
    if body.stream and body.prompt_logprobs is not None:
        raise OpenAIError(
            400, "prompt_logprobs needs stream false (prompt logprobs are not streamed)", param="prompt_logprobs"
        )
    tools = plan_tools(body, state.tool_call_parser, state.enable_auto_tool_choice)
    prompt = _Prompt(
        None,
        await state.off_loop(
            state.apply_chat_template, body.messages, body.add_generation_prompt, tools.template_tools
        ),
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling_params(state, body, body.max_completion_tokens or body.max_tokens, logprobs, tools.constraint)
    request_id = p.new_id("chatcmpl")
    (admitted,) = _admit(state, request_id, [prompt], params, bool(body.stream), body.user, prompt_param="messages")
    created = p.now()

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices: list[p.ChatChunkChoice], usage: p.Usage | None = None) -> str:
            msg = p.ChatCompletionChunk(
                id=request_id, created=created, model=state.model_name, choices=choices, usage=usage
            )
            data = msg.model_dump(exclude_none=True)
            data["choices"] = [
                {
                    "index": c.index,
                    "delta": c.delta.model_dump(exclude_none=True),
                    "logprobs": c.logprobs.model_dump() if c.logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ]
            return _sse(data)

        async def events() -> AsyncIterator[str]:
            deltas = _Deltas()
            streams = [ToolCallStream(tools) for _ in range(params.n)]
            yield chunk(
                [
                    p.ChatChunkChoice(index=j, delta=p.DeltaMessage(role="assistant", content=""))
                    for j in range(params.n)
                ]
            )
            last = None
            async for _, out in _merged(state, [admitted]):
                last = out
                for c in out.outputs:
                    text, positions, finished = deltas.take(c.index, c)
                    if not text and not positions and not finished:
                        continue  # as for completions: every new token gets a chunk
                    stream = streams[c.index]
                    content, calls = stream.feed(text, finished)
                    reason = finish_reason(tools, c.finish_reason, stream.called) if finished else None
                    yield chunk(
                        [
                            p.ChatChunkChoice(
                                index=c.index,
                                delta=p.DeltaMessage(
                                    content=content if content or not calls else None, tool_calls=calls or None
                                ),
                                logprobs=_chat_logprobs(state, c, positions),
                                finish_reason=reason,
                            )
                        ]
                    )
            if include_usage and last is not None:
                yield chunk([], _usage([last]))
            yield _sse("[DONE]")

        return _streaming(events())

    out = await _final(state, http, admitted)
    choices = []
    for c in out.outputs:
        reply = parse_reply(tools, c.text)
        choices.append(
            p.ChatChoice(
                index=c.index,
                message=p.AssistantMessage(content=reply.content, tool_calls=reply.tool_calls),
                logprobs=_chat_logprobs(state, c, list(range(len(c.token_ids)))),
                finish_reason=finish_reason(tools, c.finish_reason, bool(reply.tool_calls)),
                stop_reason=c.stop_reason,
            )
        )
    return p.ChatCompletionResponse(
        id=request_id,
        created=created,
        model=state.model_name,
        choices=choices,
        usage=_usage([out]),
        prompt_logprobs=_prompt_logprobs(state, out) if body.prompt_logprobs is not None else None,
    )


# -- models, tokenize, detokenize --------------------------------------------------------------


@router.get("/v1/models", response_model=p.ModelList)
async def models(http: Request) -> p.ModelList:
    state = get_state(http)
    return p.ModelList(
        data=[
            p.ModelCard(
                id=state.model_name,
                created=state.started_at,
                root=state.model_name,
                max_model_len=state.engine.max_model_len,
            )
        ]
    )


@router.post("/tokenize", response_model=p.TokenizeResponse)
async def tokenize(body: p.TokenizeRequest, http: Request) -> p.TokenizeResponse:
    state = get_state(http)
    _check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
    if body.tools and body.messages is None:
        raise OpenAIError(400, "tools are shown to the chat template: they need messages", param="tools")
    if body.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        ids = await state.off_loop(state.apply_chat_template, body.messages, True, tools)
    else:
        ids = await state.off_loop(state.encode, body.prompt or "", body.add_special_tokens)
    return p.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.engine.max_model_len)


@router.post("/detokenize", response_model=p.DetokenizeResponse)
async def detokenize(body: p.DetokenizeRequest, http: Request) -> p.DetokenizeResponse:
    state = get_state(http)
    _check_model(state, body.model)
    vocab = state.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise OpenAIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return p.DetokenizeResponse(prompt=state.decode(body.tokens))
