"""The offline API, vLLM-compatible: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Code written for `vllm.LLM` runs unchanged except for the import line.  Engine flags are keyword
arguments with the same names as the CLI flags (engine/config.py defines them once).
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, PromptType
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (one GPU: nothing to stop); also done at exit."""
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched by the scheduler; outputs in prompt order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt (text, dict, or a list of token ids)
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
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
