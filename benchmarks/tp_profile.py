"""Where a tensor-parallel step's time goes on rank 0's GPU: kernels by kind, how much of it overlaps, and idle.

Issue 36's 70B runs sit at 0.60 of the overlapped bound, and splitting the prefill steps into two micro-batches
(engine/model/overlap.py) gained under 1 %: whether the all-reduces run beside the GEMMs at all, slow them down,
or the GPU waits on the host cannot be told from wall times.  `profile_phases` runs two short workloads under
torch.profiler on an engine that is already up (rank 0 is this process; the other ranks run the same kernels):

    prefill          32 prompts of 512 tokens, 1 token out: steps of up to --max-num-batched-tokens tokens
    decode           256 prompts of 16 tokens, 64 out: one short prefill, then decode steps at batch 256
    prefill_overlap  the prefill again with the steps split into two micro-batches (with --overlap-ab)

and `summarize` turns the device kernels of each into milliseconds by kind (GEMM, communication, attention,
other), the union of the GEMMs' and the communication's busy time and their intersection (the all-reduce time
hidden under GEMMs), and the idle time of the GPU inside the profiled span.
"""

from __future__ import annotations

from typing import Any

KINDS = {  # a kernel's kind from its name: the first kind with a matching fragment
    "communication": ("nccl", "all_reduce", "allreduce", "two_shot", "one_shot", "symm", "cross_device"),
    "gemm": ("gemm", "gemv", "sm90_xmma", "cutlass", "nvjet", "cublas", "matmul", "_mm_", "scaled_mm", "w4a16"),
    "attention": ("attention", "attn", "flash", "cudnn", "fmha", "paged"),
}


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, fragments in KINDS.items():
        if any(f in low for f in fragments):
            return kind
    return "other"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the overlap of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(kernels: list[tuple[str, float, float]]) -> dict[str, Any]:
    """`kernels`: (name, start, end) of every device kernel, in microseconds.  Milliseconds by kind (summed kernel
    time), the span from the first kernel's start to the last's end, the GPU's busy and idle time in it, and how
    much of the communication's busy time lies under GEMMs."""
    if not kernels:
        return {"kernels": 0}
    by_kind: dict[str, list[tuple[float, float]]] = {}
    summed: dict[str, float] = {}
    for name, start, end in kernels:
        kind = kind_of(name)
        by_kind.setdefault(kind, []).append((start, end))
        summed[kind] = summed.get(kind, 0.0) + (end - start)
    span = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    busy = _length(_union([(s, e) for _, s, e in kernels]))
    gemm = _union(by_kind.get("gemm", []))
    comm = _union(by_kind.get("communication", []))
    return {
        "kernels": len(kernels),
        "span_ms": round(span / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "idle_ms": round((span - busy) / 1e3, 3),
        "kernel_ms_by_kind": {k: round(v / 1e3, 3) for k, v in sorted(summed.items())},
        "communication_busy_ms": round(_length(comm) / 1e3, 3),
        "communication_under_gemm_ms": round(_intersection(gemm, comm) / 1e3, 3),
        "top_kernels_ms": _top(kernels),
    }


def _top(kernels: list[tuple[str, float, float]], n: int = 12) -> dict[str, float]:
    totals: dict[str, float] = {}
    for name, start, end in kernels:
        totals[name[:120]] = totals.get(name[:120], 0.0) + (end - start)
    return {k: round(v / 1e3, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:n]}


def device_kernels(prof: Any) -> list[tuple[str, float, float]]:
    """(name, start, end) in microseconds of the device kernels a torch.profiler run recorded."""
    out = []
    for event in prof.events():
        if getattr(event, "device_type", None) is None or "CUDA" not in str(event.device_type):
            continue
        start = event.time_range.start
        out.append((event.name, float(start), float(start + event.time_range.elapsed_us())))
    return out


def profile_phases(
    llm: Any, vocab: int, sampling: Any, prompts_for: Any, set_overlap: Any = None, overlap_tokens: int = 0
) -> dict[str, Any]:
    """Each phase's summary (see the module's docstring), on the engine `llm` (CUDA).  With `set_overlap` (the
    runner's set_overlap_tokens) and `overlap_tokens`, the prefill phase once more as two micro-batches
    (`prefill_overlap`), the threshold put back to `set_overlap`'s idle value by the caller."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    phases: dict[str, tuple[int, int, int, int]] = {"prefill": (32, 512, 1, 0), "decode": (256, 16, 64, 0)}
    if set_overlap is not None and overlap_tokens:
        phases["prefill_overlap"] = (32, 512, 1, overlap_tokens)
    result: dict[str, Any] = {}
    for phase, (count, length, out, tokens) in phases.items():
        if tokens:
            set_overlap(tokens)
        prompts = [{"prompt_token_ids": p} for p in prompts_for(count, length, vocab, seed=7)]
        params = sampling(temperature=0, max_tokens=out, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # the same shapes once, outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
        result[phase] = {"prompts": count, "prompt_tokens": length, "output_tokens": out}
        result[phase].update(summarize(device_kernels(prof)))
    return result
