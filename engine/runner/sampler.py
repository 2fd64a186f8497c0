"""Turning logits into tokens: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Random rows use the exponential-race form of sampling (argmax of p / q with q ~ Exp(1)), which
draws exactly one random number per vocabulary entry.  A request with its own seed draws its
numbers from its own generator, so its tokens do not depend on what else is in the batch: the
same seed gives the same text whether the request runs alone, in a crowd, or after preemption.
Logprobs are those of the model's distribution (before temperature and truncation), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [S] float32; 0 means greedy
    top_p: torch.Tensor  # [S] float32
    top_k: torch.Tensor  # [S] int64; 0 means disabled
    generators: list[torch.Generator | None]  # per row; None rows use the engine's generator
    all_greedy: bool
    needs_truncation: bool
    max_top_logprobs: int  # -1: no row wants logprobs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # of the chosen tokens
    top_logprobs: list[dict[int, float]] | None


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator) -> SamplerOutput:
    logits = logits.float()
    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = _random_sample(logits, batch, generator)
        greedy_rows = batch.temperature == 0
        if bool(greedy_rows.any()):
            tokens = torch.where(greedy_rows, logits.argmax(dim=-1), tokens)

    chosen_lp = top = None
    if batch.max_top_logprobs >= 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen_lp = logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
        if batch.max_top_logprobs > 0:
            vals, ids = logprobs.topk(batch.max_top_logprobs, dim=-1)
            top = [dict(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return SamplerOutput(tokens.tolist(), chosen_lp, top)


def _random_sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator) -> torch.Tensor:
    temp = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    scaled = logits / temp[:, None]
    if batch.needs_truncation:
        scaled = _truncate(scaled, batch.top_k, batch.top_p)
    probs = torch.softmax(scaled, dim=-1)
    q = torch.empty_like(probs)
    shared_rows = [i for i, g in enumerate(batch.generators) if g is None]
    if len(shared_rows) == len(batch.generators):
        q.exponential_(generator=generator)
    else:
        if shared_rows:
            idx = torch.tensor(shared_rows, device=q.device)
            q[idx] = torch.empty_like(q[idx]).exponential_(generator=generator)
        for i, g in enumerate(batch.generators):
            if g is not None:
                q[i].exponential_(generator=g)
    return (probs / q).argmax(dim=-1)


def _truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p set (the most likely token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before > top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
