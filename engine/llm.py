"""The offline API, vLLM-compatible: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Code written for `vllm.LLM` runs unchanged except for the import line.  Engine flags are keyword
arguments with the same names as the CLI flags (engine/config.py defines them once).

A caller reads its own output beside our stderr, so start-up is one short `llm_ready` line (model, device, KV
blocks, seconds); `PAGEKEEPER_LOG_LEVEL=debug` adds the details a server logs at info (`engine_ready`, the memory
plan), `warning` leaves only what went wrong.  A program that configured structlog itself keeps its own set-up.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any, Mapping, Sequence

import structlog
from tqdm import tqdm

from engine.chat import load_chat_template, render_chat
from engine.config import ConfigError, EngineConfig
from engine.gc_heap import frozen_heap
from engine.logs import LEVELS, configure_logging, startup_details_at
from engine.loop.llm_engine import LLMEngine, PromptType
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

LOG_LEVEL_ENV = "PAGEKEEPER_LOG_LEVEL"

log = structlog.get_logger("pagekeeper.engine")


def offline_log_level() -> str:
    """The offline API's log level: PAGEKEEPER_LOG_LEVEL, else info."""
    value = os.environ.get(LOG_LEVEL_ENV, "").strip().lower() or "info"
    if value not in LEVELS:
        raise ConfigError(f"{LOG_LEVEL_ENV}={os.environ[LOG_LEVEL_ENV]!r}: not one of {', '.join(LEVELS)}")
    return value


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        started = time.monotonic()
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        if not structlog.is_configured():
            configure_logging(offline_log_level())
        with startup_details_at(logging.DEBUG):
            self.llm_engine = LLMEngine(config)
        self._ids = itertools.count()
        facts = self.llm_engine.core.facts
        log.info(
            "llm_ready",
            model=config.model_name(),
            device=facts.device,
            kv_blocks=facts.num_blocks,
            seconds=round(time.monotonic() - started, 2),
        )

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (one GPU: nothing to stop); also done at exit."""
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate()` and `chat()` use when given no SamplingParams: the checkpoint's recommended
        sampling from its generation_config.json (`generation_config="vllm"` turns that off), as vLLM."""
        return SamplingParams(**self.llm_engine.generation_defaults)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of OpenAI-style messages) or to several (a list of
        them), rendered by the model's chat template or `chat_template` (a file or the template itself).

        The rendered text is tokenized without adding special tokens: the template writes them itself (a BOS
        added twice changes a model's answers)."""
        if messages and isinstance(messages[0], Mapping):
            conversations = [messages]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        template = load_chat_template(chat_template, "chat_template")
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = render_chat(
                tokenizer,
                conversation,  # type: ignore[arg-type]
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template=template,
                chat_template_kwargs=chat_template_kwargs,
            )
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched by the scheduler; outputs in prompt order."""
        # the collector's full passes would walk the engine's start-up heap between steps (engine/gc_heap.py)
        with frozen_heap():
            return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt (text, dict, or a list of token ids)
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")

        engine = self.llm_engine
        order: dict[str, int] = {}
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, params, output_kind=RequestOutputKind.FINAL_ONLY)
                order[rid] = i
            results: list[RequestOutput | None] = [None] * len(prompts)
            with tqdm(total=len(prompts), desc="generate", disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step(finished_only=True):
                        if out.finished:
                            results[order[out.request_id]] = out
                            bar.update(1)
        except BaseException:
            for rid in order:
                engine.abort_request(rid)
            raise
        return [r for r in results if r is not None]
