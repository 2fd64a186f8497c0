"""The FP8 KV cache's scales: one power of two per layer, K/V and KV head, calibrated at start-up.

Why calibrated at start-up (and not read from the checkpoint): every model gets scales, including
the 16-bit checkpoints that never had any, from the same code on every rank; a checkpoint's
per-tensor k/v scales would cover only the few models quantized with KV calibration, and are
refused rather than half-used (engine/model/quant/spec.py).  Why per KV head: heads differ by
orders of magnitude in some models (and a tensor-parallel rank holds whole heads, so its scales
are its own, no agreement needed); one scalar per head is also free in the kernels, which handle
one KV head per program.  Why powers of two: dividing and multiplying by one is exact, so the e4m3
rounding is the only error and every backend stores the same bytes.

The calibration pass runs one prefill of `CALIBRATION_SEQS` pseudo-random prompts (seeded: the
same on every rank and every start) through a throwaway cache in the model's dtype, and records
the largest |k| and |v| each head wrote.  The scale puts that value at 448 / HEADROOM of e4m3's
range, rounded up to a power of two.  Headroom is nearly free in a floating-point format: the
relative precision is the same across its 15 binades, so keeping 4-8x above the calibrated maximum
costs only values 2^13 times smaller than it (which become subnormal), while traffic that runs
hotter than random prompts saturates at 448 instead of overflowing.
"""

from __future__ import annotations

import math

import structlog
import torch
from torch import nn

from engine.config import ResolvedConfig
from engine.core.plan import NewSeq, SamplingSpec, SeqStep, StepPlan
from engine.logs import startup_detail
from engine.model.interface import CausalLM
from engine.model.layers.attention import PagedAttention
from engine.runner.model_runner import ModelRunner

log = structlog.get_logger("pagekeeper.engine")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
HEADROOM = 4.0
CALIBRATION_SEQS = 4
CALIBRATION_LEN = 512
CALIBRATION_SEED = 20


def kv_cache_dtype(config: ResolvedConfig) -> torch.dtype:
    """The KV cache's storage dtype as torch names it: the one `EngineConfig.resolve` chose (float8_e4m3fn for
    --kv-cache-dtype fp8, else the model's)."""
    dtype = getattr(torch, config.kv_dtype)
    assert isinstance(dtype, torch.dtype), config.kv_dtype
    return dtype


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Powers of two with amax x HEADROOM / scale <= 448 (a head that wrote only zeros gets 1)."""
    wanted = (amax.float() * HEADROOM / FP8_MAX).clamp(min=2.0**-60)
    scale = torch.exp2(torch.ceil(torch.log2(wanted)))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _attention_layers(model: nn.Module) -> list[PagedAttention]:
    return [m for m in model.modules() if isinstance(m, PagedAttention)]


@torch.inference_mode()
def calibrate_kv_scales(
    config: ResolvedConfig, model: CausalLM, vocab: int, dtype: torch.dtype, device: torch.device
) -> dict[str, float]:
    """Run the calibration pass and set every attention layer's `kv_scale`; returns a summary for the log."""
    length = min(config.max_model_len, CALIBRATION_LEN)
    seqs = max(1, min(CALIBRATION_SEQS, config.max_num_batched_tokens // length))
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    bs = config.block_size
    blocks_per_seq = -(-length // bs)
    plan = StepPlan(num_batched_tokens=seqs * length)
    greedy = SamplingSpec(temperature=0.0)
    for i in range(seqs):
        sid = f"kv-calibration-{i}"
        ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
        plan.new_seqs.append(NewSeq(sid, greedy))
        table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        plan.seqs.append(SeqStep(sid, 0, length, ids, table_blocks=table, sample_ids=[sid]))
    layers = _attention_layers(model)
    for attn in layers:
        attn.kv_amax = torch.zeros_like(attn.kv_scale)
    try:
        runner = ModelRunner(model, seqs * blocks_per_seq, bs, dtype, device, config.seed, max_num_seqs=seqs)
        runner.execute(plan)
        del runner
    finally:
        amaxes = [attn.kv_amax for attn in layers]
        for attn in layers:
            attn.kv_amax = None
    scales = []
    for attn, amax in zip(layers, amaxes):
        assert amax is not None
        attn.kv_scale.copy_(scales_from_amax(amax))
        scales.append(attn.kv_scale)
    every = torch.stack(scales)
    summary = {
        "kv_scale_min": float(every.min()),
        "kv_scale_max": float(every.max()),
        "kv_amax_max": float(torch.stack([a for a in amaxes if a is not None]).max()),
        "calibration_tokens": float(seqs * length),
    }
    startup_detail(
        log,
        "kv_cache_fp8_scales",
        source="calibrated at start-up",
        layers=len(layers),
        headroom=HEADROOM,
        scale_log2_range=[int(math.log2(summary["kv_scale_min"])), int(math.log2(summary["kv_scale_max"]))],
        **summary,
    )
    return summary
