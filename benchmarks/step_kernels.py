"""The device kernels of sampled engine steps, by category, against each category's own ceiling.

`benchmarks.step_phases --kernel-profile N` runs N decode steps and N mixed steps (spread over the run) under
torch's profiler and hands their kernel events here.  A step's span splits into:

- `gemm`: cuBLAS / CUTLASS products (the projections and the LM head), against the step's linear FLOPs at the
  matmul rate or its weight bytes at copy bandwidth, whichever is larger;
- `decode_attention`, `prefill_attention` (the paged Triton kernels), `dense_attention` (cuDNN): against the KV
  bytes the step reads at copy bandwidth;
- `kv_write`, `norm`, `silu_mul`, `rotary`, `sampling`, `copy` (memcpy / memset / the piece buffers' copies),
  `other`;
- `gaps`: the span less the kernels' sum (the device idle inside the step: launches, waits, syncs).

That says which category holds the time a step loses against its bound, which the step totals cannot.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Iterable

# (category, substrings of the kernel name), first match wins; the order matters ("gemm" before "copy": a GEMM's
# name may hold "copy" in a template argument).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("decode_attention", ("_decode_kernel", "_decode_reduce_kernel")),
    ("prefill_attention", ("_prefill_kernel",)),
    ("dense_attention", ("cudnn", "fmha", "flash", "sdpa", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce", "sm90_", "sm80_")),
    ("kv_write", ("_write_kv",)),
    ("norm", ("rms_norm", "_norm_kernel")),
    ("silu_mul", ("silu",)),
    ("rotary", ("rotary", "rope")),
    ("sampling", ("argmax", "softmax", "sample", "topk", "sort", "gather", "multinomial", "exponential", "logit")),
    ("copy", ("memcpy", "memset", "copy", "fill", "cat")),
)


def classify(kernel: str, table: Iterable[tuple[str, tuple[str, ...]]]) -> str:
    """The first (name, needles) entry of `table` one of whose needles is in the kernel's name (lower case), else
    "other"."""
    name = kernel.lower()
    for kind, needles in table:
        if any(n in name for n in needles):
            return kind
    return "other"


def category(kernel: str) -> str:
    return classify(kernel, CATEGORIES)


def step_breakdown(kernels: Iterable[tuple[str, float]], span_ms: float) -> dict[str, float]:
    """Milliseconds per category of one step from its (kernel name, device ms) events; `gaps` is the span the
    kernels did not cover (kernels never overlap within a step: one stream)."""
    out: dict[str, float] = defaultdict(float)
    for name, ms in kernels:
        out[category(name)] += ms
    busy = sum(out.values())
    out["gaps"] = max(0.0, span_ms - busy)
    return dict(out)


def summarise(
    samples: list[dict[str, Any]], matmul_flops: float, copy_bytes_per_s: float, top: int = 12
) -> dict[str, Any]:
    """Per kind of step: the mean milliseconds per category, each category's own ceiling where it has one, and the
    kernels that took the most time.  `samples`: dicts with kind, span_ms, kernels [(name, ms)], and the step's work
    (`linear_flops`, `weight_bytes`, `kv_bytes`, `bound_ms`, `tokens`, `seqs`)."""
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        by_kind[s["kind"]].append(s)
    result: dict[str, Any] = {}
    for kind, rows in sorted(by_kind.items()):
        n = len(rows)
        cats: dict[str, float] = defaultdict(float)
        names: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for r in rows:
            for cat, ms in step_breakdown(r["kernels"], r["span_ms"]).items():
                cats[cat] += ms / n
            for name, ms in r["kernels"]:
                names[name][0] += 1 / n
                names[name][1] += ms / n
        gemm_floor = statistics.fmean(
            1e3 * max(r["linear_flops"] / matmul_flops, r["weight_bytes"] / copy_bytes_per_s) for r in rows
        )
        kv_floor = statistics.fmean(1e3 * r["kv_bytes"] / copy_bytes_per_s for r in rows)
        attention = sum(cats.get(c, 0.0) for c in ("decode_attention", "prefill_attention", "dense_attention"))
        span = statistics.fmean(r["span_ms"] for r in rows)
        result[kind] = dict(
            steps=n,
            tokens_mean=round(statistics.fmean(r["tokens"] for r in rows), 1),
            seqs_mean=round(statistics.fmean(r["seqs"] for r in rows), 1),
            span_ms=round(span, 3),
            bound_ms=round(statistics.fmean(r["bound_ms"] for r in rows), 3),
            ms_per_step={c: round(v, 3) for c, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            share_of_span={c: round(v / span, 4) for c, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            # each category at its own ceiling over what it took: below 1 is what it loses
            gemm_floor_ms=round(gemm_floor, 3),
            gemm_efficiency=round(gemm_floor / max(1e-9, cats.get("gemm", 0.0)), 4),
            attention_floor_ms=round(kv_floor, 3),
            attention_efficiency=round(kv_floor / max(1e-9, attention), 4),
            top_kernels=[
                dict(name=name[:160], calls_per_step=round(c, 2), ms_per_step=round(ms, 4))
                for name, (c, ms) in sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
            ],
        )
    return result
