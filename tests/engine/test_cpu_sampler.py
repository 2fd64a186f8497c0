"""The CPU's sampler (one uniform number per row against the row's cumulative distribution): it
samples the distribution, never a token without mass, and a seeded row's tokens do not depend on the
rows beside it."""

from __future__ import annotations

import torch

from engine.runner.sampler import SamplingBatch, _inverse_cdf_sample


def _batch(generators: list) -> SamplingBatch:
    return SamplingBatch(None, None, None, generators, False, False, False, -1)


def test_frequencies_follow_the_distribution_and_masked_tokens_never_come():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(64) * 2, dim=-1)
    probs[[3, 17, 40]] = 0.0  # masked (top-k, top-p, a grammar)
    probs /= probs.sum()
    draws = 40_000
    tokens = _inverse_cdf_sample(probs.repeat(draws, 1), _batch([None] * draws), torch.Generator().manual_seed(1))
    freq = torch.bincount(tokens, minlength=64).double() / draws
    se = (probs.double() * (1 - probs.double()) / draws).sqrt()
    z = ((freq - probs.double()) / se.clamp(min=1e-12))[probs > 0]
    masked = int(freq[[3, 17, 40]].sum())
    print(f"{draws} draws over 64 tokens: max |z| = {z.abs().max():.2f}, masked tokens drawn: {masked}")
    assert z.abs().max() < 5 and freq[[3, 17, 40]].sum() == 0


def test_a_seeded_row_is_the_same_alone_and_in_a_crowd():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(5, 1000), dim=-1)

    def seeded(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    alone = [int(_inverse_cdf_sample(probs[2:3], _batch([seeded(7)]), torch.Generator())[0]) for _ in range(1)]
    gens = [None, seeded(3), seeded(7), None, seeded(9)]
    crowd = _inverse_cdf_sample(probs, _batch(gens), torch.Generator().manual_seed(5))
    assert int(crowd[2]) == alone[0]
