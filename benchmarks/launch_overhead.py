"""Host microseconds per call of each kernel entry point a layer runs in an eager (mixed) step (GPU).

    python -m benchmarks.launch_overhead [--tokens 600] [--decodes 100] [--calls 300] [--out DIR]

A mixed step (decodes batched with prefill chunks) runs eagerly, and on an H100 its launches took longer
than its kernels (benchmarks/step_phases.py: 24 ms of host time against 27 ms of device time per mixed step,
59 % of mixed steps paced by the host).  This times what the host spends queueing each call, at the
Llama-3-8B shape of one layer: `calls` back-to-back calls with no synchronisation, divided by `calls`.  The
kernels are small enough that the GPU keeps up, so the figure is the launch path's own cost (Python argument
handling, Triton's dispatch, cuDNN's plan lookup), and `device_us` is the same calls' device time
(CUDA events), for comparison.  JSON: `<out>/launch-overhead-<gpu>-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.kernels import gpu_slug
from benchmarks.throughput import RESULTS


def _time(fn: Callable[[], object], calls: int) -> dict[str, float]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t
    end.record()
    torch.cuda.synchronize()
    return dict(host_us=round(1e6 * host / calls, 2), device_us=round(1e3 * start.elapsed_time(end) / calls, 2))


def measure(tokens: int, decodes: int, calls: int) -> dict[str, dict[str, float]]:
    from kernels import cache_ops, fused_ops, triton_backend
    from kernels.dense_prefill import DenseChunks, runs_of
    from kernels.paged_attention import paged_attention_decode, paged_attention_prefill

    dev, dt_ = torch.device("cuda"), torch.bfloat16
    hidden, heads, kv_heads, hd, inter, bs = 4096, 32, 8, 128, 14336, 16
    chunk = tokens - decodes
    ctx = 512
    nblocks = 4096
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, hidden, device=dev, dtype=dt_, generator=g)
    res = torch.randn_like(x)
    w = torch.ones(hidden, device=dev, dtype=dt_)
    wqkv = torch.randn((heads + 2 * kv_heads) * hd, hidden, device=dev, dtype=dt_, generator=g) * 0.02
    qkv = x @ wqkv.t()
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q, k, v = q.view(tokens, heads, hd), k.view(tokens, kv_heads, hd), v.view(tokens, kv_heads, hd)
    cos = torch.randn(4096, hd // 2, device=dev)
    sin = torch.randn(4096, hd // 2, device=dev)
    positions = torch.arange(tokens, device=dev)
    cache = torch.zeros(2, nblocks, kv_heads, bs, hd, device=dev, dtype=dt_)
    slots = torch.randperm(nblocks * bs, device=dev, generator=g)[:tokens]
    batch = decodes + 1
    per_seq = -(-(ctx + chunk) // bs)
    tables = torch.arange(batch * per_seq, device=dev, dtype=torch.int32).view(batch, per_seq) % nblocks
    seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    seq_lens[-1] = ctx + chunk
    qsl = torch.tensor(list(range(decodes + 1)) + [tokens], device=dev, dtype=torch.int32)
    gate_up = torch.randn(tokens, 2 * inter, device=dev, dtype=dt_, generator=g)
    wo = torch.randn(hidden, heads * hd, device=dev, dtype=dt_, generator=g) * 0.02
    out = torch.empty_like(q)
    scale = hd**-0.5
    fresh = 1024
    fq = torch.randn(fresh, heads, hd, device=dev, dtype=dt_, generator=g)
    fk = torch.randn(fresh, kv_heads, hd, device=dev, dtype=dt_, generator=g)
    dense = DenseChunks(runs_of([fresh], 0), 1, 0)
    triton_backend.warm_dense_prefill(dt_, heads, kv_heads, hd, dev, 8192)
    rows = {
        "torch_mm_o_proj": lambda: torch.mm(q.view(tokens, -1), wo.t()),
        "torch_add": lambda: torch.add(x, res),
        "rms_norm_add": lambda: fused_ops.rms_norm(x, w, 1e-5, res),
        "rotary": lambda: fused_ops.rotary(q, k, positions, cos, sin),
        "silu_mul": lambda: fused_ops.silu_mul(gate_up),
        "write_kv": lambda: cache_ops.write_kv(k, v, cache, slots),
        "paged_decode": lambda: paged_attention_decode(
            q[:decodes], cache, tables[:decodes], seq_lens[:decodes], scale, ctx, out=out[:decodes]
        ),
        "paged_prefill": lambda: paged_attention_prefill(
            q, cache, tables, seq_lens, qsl, scale, chunk, out=out, first_seq=decodes, num_seqs=1
        ),
        "dense_prefill_cudnn": lambda: triton_backend.paged_attention(
            fq, cache, tables[:1], seq_lens[:1], qsl[:2], scale, fresh, fresh, dense=dense, fresh_kv=(fk, fk)
        ),
        "paged_attention_mixed": lambda: triton_backend.paged_attention(
            q, cache, tables, seq_lens, qsl, scale, chunk, ctx + chunk, out=out, num_decodes=decodes
        ),
    }
    result = {name: _time(fn, calls) for name, fn in rows.items()}
    result.update(gemm_shapes(hidden, heads * hd, calls))
    result.update(waits_for_the_device(hidden))
    return result


def waits_for_the_device(hidden: int, vocab: int = 128256) -> dict[str, dict[str, float]]:
    """Whether a GEMM call waits for the work queued before it: each call is made while the GPU still has about
    20 ms of queued work (`torch.cuda._sleep`); a call that returns in microseconds did not wait, one that takes
    about 20 ms did (a synchronising module load, say).  Rows: the LM head (`vocab` columns) at a row count seen
    for the first time, at one seen before, and a projection at a first-time row count."""
    dev, dt_ = torch.device("cuda"), torch.bfloat16
    head = torch.randn(vocab, hidden, device=dev, dtype=dt_) * 0.02
    proj = torch.randn(hidden, hidden, device=dev, dtype=dt_) * 0.02
    x = torch.randn(8192, hidden, device=dev, dtype=dt_)
    cycles = 20_000_000  # about 10-20 ms at H100/H200 clocks

    def probe(fn: Callable[[int], object], rows: list[int]) -> dict[str, float]:
        waits = []
        for m in rows:
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            t = time.perf_counter()
            fn(m)
            waits.append(1e3 * (time.perf_counter() - t))
            torch.cuda.synchronize()
        waits.sort()
        return dict(calls=len(rows), median_host_ms=round(waits[len(waits) // 2], 3), max_host_ms=round(waits[-1], 3))

    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    queued_ms = 1e3 * (time.perf_counter() - t)
    rows = {
        "lm_head_first_time_rows": probe(lambda m: x[:m] @ head.t(), list(range(3, 250, 7))),
        "lm_head_rows_seen_before": probe(lambda m: x[:m] @ head.t(), list(range(3, 250, 7))),
        "projection_first_time_rows": probe(lambda m: x[:m] @ proj.t(), list(range(517, 8000, 211))),
        "projection_rows_seen_before": probe(lambda m: x[:m] @ proj.t(), list(range(517, 8000, 211))),
    }
    return {k: dict(v, queued_ms=round(queued_ms, 2)) for k, v in rows.items()}


def gemm_shapes(hidden: int, width: int, calls: int) -> dict[str, dict[str, float]]:
    """A projection's host cost when every call has a row count never seen before (an eager mixed step's token
    count: 557 median in the long-tailed run), against the same rows every time and rows rounded up to a
    multiple of 64, on each BLAS library torch offers."""
    dev, dt_ = torch.device("cuda"), torch.bfloat16
    w = torch.randn(hidden, width, device=dev, dtype=dt_) * 0.02
    x = torch.randn(4096, width, device=dev, dtype=dt_)
    out: dict[str, dict[str, float]] = {}
    before = torch.backends.cuda.preferred_blas_library()
    try:
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            fresh = iter(range(1000 + 3 * calls * (lib == "cublaslt"), 10**6))
            out[f"mm_{lib}_same_rows"] = _time(lambda: torch.mm(x[:557], w.t()), calls)
            out[f"mm_{lib}_new_rows_each_call"] = _time(lambda: torch.mm(x[: next(fresh) % 3000 + 64], w.t()), calls)
            fresh64 = iter(range(10**6))
            out[f"mm_{lib}_rows_to_64"] = _time(
                lambda: torch.mm(x[: -(-(next(fresh64) % 3000 + 64) // 64) * 64], w.t()), calls
            )
    finally:
        torch.backends.cuda.preferred_blas_library(before)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=600, help="tokens in the step (decodes + one chunk)")
    p.add_argument("--decodes", type=int, default=100, help="one-token sequences in the step")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if not 0 < args.decodes < args.tokens:
        p.error("--decodes must be between 1 and --tokens - 1")
    if not torch.cuda.is_available():
        print("benchmarks.launch_overhead needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    rows = measure(args.tokens, args.decodes, args.calls)
    name = torch.cuda.get_device_name()
    result = dict(
        gpu=name,
        date=dt.date.today().isoformat(),
        command="python -m benchmarks.launch_overhead " + " ".join(sys.argv[1:] if argv is None else argv),
        torch=torch.__version__,
        triton=triton.__version__,
        tokens=args.tokens,
        decodes=args.decodes,
        calls=args.calls,
        per_call=rows,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"launch-overhead-{gpu_slug(name)}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
