"""GPU benchmark of the Triton paged-attention kernels against torch SDPA on contiguous K/V.

    python -m benchmarks.kernels [--out benchmarks/results] [--quick] [--sweep] [--no-prefill]

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head dim 128), bfloat16, random data.
Everything is measured in one process, one run.  `*_ms` is the median of 100 CUDA-graph replays timed
with CUDA events, the L2 cache flushed (a 256 MiB write) before each replay: the device time of the
kernels, as captured decode steps run them.  `*_eager_ms` is `triton.testing.do_bench`'s median of
eager calls, which also shows the host's launch cost wherever that exceeds the kernel's time
(`host_overhead_us` measures it per call).

- `copy_TBps`: a large device-to-device copy (bytes read + bytes written over time): the practical
  memory-bandwidth ceiling of this GPU in this run.
- decode, one row per (batch, context, block_size): batch 1/16/64/256 x context 512/2048/8192 at
  block 16, plus batch 64 x context 4096 at blocks 8, 16 and 32.  `paged_ms` is the engine's entry
  point (`kernels.triton_backend.paged_attention`) over a cache whose block tables are random
  permutations; `contiguous_ms` is `F.scaled_dot_product_attention` (enable_gqa) over the very same
  K/V laid out contiguously `[B, Hkv, ctx, D]`, with torch's default backend choice (each fused
  backend's own time is in `contiguous_backend_ms`).  `bytes_read` counts K, V, the queries and the
  block tables; `achieved_TBps` = (bytes_read + output bytes) / paged time, comparable to copy_TBps.
- prefill (`PREFILL_SHAPES`): fresh 2,048-token chunks, a 2,048 chunk after 2,048 cached tokens, and
  512 / 8,192-token chunks after a 4,096-token cached prefix, against SDPA on the same contiguous data
  (causal; a chunk after context uses a lower-right causal mask) and against cuDNN's SDPA alone
  (`prefill_over_cudnn`, the ratio issue 21 targets at <= 1.10).
- `--sweep`: decode/prefill tile configurations at batch 64 x 4096 / batch 1-4 x 2048, to pick the table.

Each row also records the paged output's relative error against SDPA's, so that the timed kernel is
known to compute the same thing.  The JSON goes to `<out>/kernels-<gpu>-<YYYY-MM-DD>.json`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
DEVICE = "cuda"


def _bench_eager(fn, rep: int = 100) -> float:
    """do_bench's median: events around each eager call (host launch cost shows when the kernel is short)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))


_FLUSH: torch.Tensor | None = None
EAGER_FALLBACKS: list[str] = []  # what could not be graph-captured (timed eagerly instead)


def _flush_buffer() -> torch.Tensor:
    """256 MiB on the device, made once: written or read before a timed replay to empty L2."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.int8, device=DEVICE)
    return _FLUSH


def _captured(fns, warmups: int, label: str) -> torch.cuda.CUDAGraph | None:
    """One CUDA graph of `fns` called in order, after `warmups` rounds on a side stream (as torch.cuda.graphs
    recommends); None, with the reason in EAGER_FALLBACKS, where they cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
    except Exception as e:  # noqa: BLE001 - the caller times it another way
        torch.cuda.synchronize()
        EAGER_FALLBACKS.append(f"{getattr(fns[0], '__qualname__', fns[0])}{label}: {str(e)[:160]}")
        return None
    return graph


def _bench(fn, reps: int = 100) -> float:
    """Median device time of `fn` replayed from a CUDA graph, with L2 flushed before every replay.

    The kernel time as the engine's captured decode steps see it: cold L2 (a 256 MiB write before each
    replay), no host launch cost (the replay is queued while the flush runs).  Falls back to eager
    do_bench if `fn` cannot be captured.
    """
    flush = _flush_buffer()
    graph = _captured([fn], warmups=3, label="")
    if graph is None:  # not capturable: time it eagerly
        return _bench_eager(fn)
    for _ in range(5):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return float(statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends)))


def bench_rotating(fns, reps: int = 30) -> float:
    """Median device time of one call, from a CUDA graph of `fns` run back to back (the same kernel on different
    copies of its weight, together larger than L2), divided by their number.

    As a captured decode step runs its layers: each call's weight comes from HBM, and no flush sits between two
    calls.  `_bench`'s flush writes 256 MiB before its one call, whose reads then first evict the dirty lines (up
    to L2's size of extra traffic), and its per-replay fixed cost of several microseconds is most of the time of
    a projection of a few megabytes; here both spread over len(fns) calls.  L2 is emptied before each replay by
    a read (a sum), which leaves no dirty lines.  Falls back to _bench of the first call where the graph cannot
    be captured."""
    flush = _flush_buffer()
    graph = _captured(fns, warmups=1, label=" (rotating)")
    if graph is None:  # not capturable: the single-call timer
        return _bench(fns[0])
    graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    sink = torch.empty((), dtype=torch.int64, device=DEVICE)
    for i in range(reps):
        torch.sum(flush.view(-1), dim=0, dtype=torch.int64, out=sink)  # L2 holds the flush buffer, clean (torch 2.11
        # has no out= without dim)
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return float(statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends))) / len(fns)


def host_overhead_us(fn, n: int = 300) -> float:
    """Host time per eager call (launch cost), on a shape whose device time is shorter than that."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return round((t1 - t0) / n * 1e6, 1)


def gpu_slug(name: str) -> str:
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name.upper())
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name.lower())).lower()


def interpreted_or_cuda(quick: bool) -> torch.device | None:
    """The device a Triton kernel benchmark times on: CUDA, or with `quick` the CPU under Triton's interpreter; None
    (after one error line) when neither is possible, for the caller's exit 2."""
    import os

    if not quick and not torch.cuda.is_available():
        print("error: no CUDA device; use --quick for the CPU dry run", file=sys.stderr)
        return None
    if quick and os.environ.get("TRITON_INTERPRET") != "1":
        print("error: --quick runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
        return None
    return torch.device("cpu" if quick else "cuda")


def device_slug(gpu: bool) -> str:
    """The device's name in results files: the GPU's slug (h100, h200) when the run uses it, else cpu."""
    return gpu_slug(torch.cuda.get_device_name()) if gpu else "cpu"


def run_header(module: str, args: list[str], gpu: bool, timer: str) -> dict[str, Any]:
    """The fields every kernel benchmark's results JSON opens with: the device, the date, the command that
    reproduces it (`python -m benchmarks.<module> ARGS`), torch's and triton's versions and how it timed."""
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "date": _dt.date.today().isoformat(),
        "command": f"python -m benchmarks.{module} " + " ".join(args),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "timer": timer,
    }


def copy_tbps(nbytes: int = 2 << 30) -> float:
    src = torch.randint(-128, 127, (nbytes,), dtype=torch.int8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = _bench_eager(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e12


def paged_setup(batch: int, context: int, block_size: int, q_len: int = 1, seed: int = 0):
    """Random paged cache with shuffled block tables, and the same K/V contiguous [B, Hkv, ctx, D]."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    nblk = -(-context // block_size)
    pool = batch * nblk + 16
    cache = torch.randn(2, pool, HKV, block_size, D, generator=g, device=DEVICE, dtype=DTYPE)
    tables = torch.randperm(pool, generator=g, device=DEVICE)[: batch * nblk].view(batch, nblk).to(torch.int32)
    query = torch.randn(batch * q_len, HQ, D, generator=g, device=DEVICE, dtype=DTYPE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=DEVICE)

    def contiguous(x: torch.Tensor) -> torch.Tensor:
        y = x[tables.long()]  # [B, nblk, Hkv, bs, D]
        return y.permute(0, 2, 1, 3, 4).reshape(batch, HKV, nblk * block_size, D)[:, :, :context].contiguous()

    k, v = contiguous(cache[0]), contiguous(cache[1])
    return cache, tables, query, seq_lens, qsl, k, v


def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }


def _sdpa_times(fn) -> tuple[float, dict[str, float | str]]:
    """Default dispatch time, and each fused backend's time (or why it could not run)."""
    from torch.nn.attention import sdpa_kernel

    default = _bench(fn)
    per: dict[str, float | str] = {}
    for name, backend in _sdpa_backends().items():
        try:
            with sdpa_kernel([backend]):
                fn()
                per[name] = _bench(fn)
        except Exception as e:  # noqa: BLE001 - a backend that cannot take these inputs
            per[name] = f"n/a: {(str(e).splitlines() or [type(e).__name__])[0][:160]}"
    return default, per


def _best(default: float, per_backend: dict) -> float:
    return min([default] + [t for t in per_backend.values() if isinstance(t, float)])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def decode_row(batch: int, context: int, block_size: int, copy: float) -> dict:
    from kernels import paged_attention as pa
    from kernels import triton_backend

    cache, tables, query, seq_lens, qsl, k, v = paged_setup(batch, context, block_size)
    scale = D**-0.5

    def paged():
        return triton_backend.paged_attention(query, cache, tables, seq_lens, qsl, scale, 1, context)

    q4 = query.view(batch, HQ, 1, D)

    def sdpa():
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    err = _rel(paged(), sdpa().view(batch, HQ, D))
    paged_ms = _bench(paged)
    contiguous_ms, per_backend = _sdpa_times(sdpa)
    paged_eager_ms, contiguous_eager_ms = _bench_eager(paged), _bench_eager(sdpa)
    bytes_read = _decode_bytes_read(cache, query, tables, seq_lens, batch, context)
    achieved = (bytes_read + query.numel() * query.element_size()) / (paged_ms * 1e-3) / 1e12  # + the output
    cache = k = v = None  # frees the memory now (a closure above still names it)
    return dict(
        batch=batch,
        context=context,
        block_size=block_size,
        paged_ms=round(paged_ms, 5),
        contiguous_ms=round(contiguous_ms, 5),
        paged_eager_ms=round(paged_eager_ms, 5),
        contiguous_eager_ms=round(contiguous_eager_ms, 5),
        contiguous_backend_ms={n: (round(t, 5) if isinstance(t, float) else t) for n, t in per_backend.items()},
        contiguous_best_ms=round(_best(contiguous_ms, per_backend), 5),
        bytes_read=bytes_read,
        achieved_TBps=round(achieved, 4),
        copy_TBps=round(copy, 4),
        pct_of_copy=round(100 * achieved / copy, 1),
        paged_over_contiguous=round(paged_ms / contiguous_ms, 3),
        paged_over_best_contiguous=round(paged_ms / _best(contiguous_ms, per_backend), 3),
        num_splits=pa.num_decode_splits(batch, HKV, context, query.device),
        rel_err_vs_sdpa=err,
    )


def _decode_bytes_read(cache, query, tables, seq_lens, batch: int, context: int) -> int:
    elt = cache.element_size()
    return 2 * batch * context * HKV * D * elt + query.numel() * elt + tables.numel() * 4 + seq_lens.numel() * 4


def _cudnn_ms(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, context: int, scale: float):
    """cuDNN's SDPA over contiguous K/V: (ms, how it was called), or (None, why it could not run).

    GQA is passed through where cuDNN takes it, else K/V are expanded to every query head outside the
    timing.  A chunk after cached context needs the lower-right causal mask, given as a dense additive
    bias (cuDNN's path for arbitrary masks), also built outside the timing.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = HQ // HKV
    ke = ve = mask = None
    attempts = []
    if chunk == context:
        attempts.append(
            (
                "causal, gqa",
                lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, is_causal=True, enable_gqa=True),
            )
        )
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if chunk == context:
        attempts.append(
            ("causal, expanded K/V", lambda: F.scaled_dot_product_attention(q4, ke, ve, scale=scale, is_causal=True))
        )
    else:
        rows = torch.arange(chunk, device=DEVICE)[:, None] + (context - chunk)
        visible = torch.arange(context, device=DEVICE)[None, :] <= rows
        mask = torch.zeros(chunk, context, device=DEVICE, dtype=DTYPE).masked_fill_(~visible, float("-inf"))
        mask = mask[None, None]
        attempts.append(
            (
                "lower-right causal bias, expanded K/V",
                lambda: F.scaled_dot_product_attention(q4, ke, ve, attn_mask=mask, scale=scale),
            )
        )
    why = []
    for how, fn in attempts:
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ref = fn()
                ms = _bench(fn)
            return ms, how, ref
        except Exception as e:  # noqa: BLE001 - this torch/cuDNN cannot take these inputs
            why.append(f"{how}: {(str(e).splitlines() or [type(e).__name__])[0][:160]}")
    return None, "; ".join(why), None


def _engine_layout(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, chunk: int):
    """The chunk's q, k, v as the model hands them to attention: strided views of one fused projection output
    ``[T, (Hq + 2 Hkv) D]`` (k, v: the last `chunk` positions of each sequence's contiguous K/V)."""
    t = batch * chunk
    kf = k[:, :, -chunk:].transpose(1, 2).reshape(t, HKV * D)
    vf = v[:, :, -chunk:].transpose(1, 2).reshape(t, HKV * D)
    fused = torch.cat([query.reshape(t, HQ * D), kf, vf], dim=1)
    q, kk, vv = fused.split([HQ * D, HKV * D, HKV * D], dim=1)
    return q.view(t, HQ, D), kk.view(t, HKV, D), vv.view(t, HKV, D)


def prefill_row(batch: int, chunk: int, context: int, block_size: int) -> dict:
    """`paged_ms` times the engine's entry point (`kernels.triton_backend.paged_attention`) as the runner calls
    it: a fresh chunk (no context before it) on the dense path over the step's own K/V when the backend takes
    it here, else the paged prefill kernel with its automatic tile choice; `triton_ms` is the paged kernel
    alone on the same rows."""
    from kernels import paged_attention as pa
    from kernels import triton_backend
    from kernels.dense_prefill import DenseChunks, runs_of

    cache, tables, query, seq_lens, qsl, k, v = paged_setup(batch, context, block_size, q_len=chunk)
    scale = D**-0.5
    q_eng, k_eng, v_eng = _engine_layout(query, k, v, batch, chunk)
    takes = triton_backend.dense_prefill_lengths(DTYPE, DTYPE, HQ, HKV, D, query.device)
    dense = None
    if chunk == context and takes is not None and takes(chunk):
        dense = DenseChunks(runs_of([chunk] * batch, 0), batch, 0)

    def paged():
        return triton_backend.paged_attention(
            q_eng, cache, tables, seq_lens, qsl, scale, chunk, context, dense=dense, fresh_kv=(k_eng, v_eng)
        )

    def triton_only():
        return pa.paged_attention_prefill(query, cache, tables, seq_lens, qsl, scale, chunk)

    q4 = query.view(batch, chunk, HQ, D).transpose(1, 2)
    if chunk == context:

        def sdpa():
            return F.scaled_dot_product_attention(q4, k, v, scale=scale, is_causal=True, enable_gqa=True)
    else:
        from torch.nn.attention.bias import causal_lower_right

        ke, ve = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)  # outside the timing
        mask = causal_lower_right(chunk, context)

        def sdpa():
            return F.scaled_dot_product_attention(q4, ke, ve, attn_mask=mask, scale=scale)

    out = paged()
    err = _rel(out, sdpa().transpose(1, 2).reshape(batch * chunk, HQ, D))
    paged_ms = _bench(paged)
    paged_eager_ms = _bench_eager(paged)
    triton_ms = _bench(triton_only) if dense is not None else paged_ms
    sdpa_ms, per_backend = _sdpa_times(sdpa) if chunk == context else (_bench(sdpa), {})
    cudnn_ms, cudnn_how, cudnn_out = _cudnn_ms(q4, k, v, chunk, context, scale)
    cudnn_err = None if cudnn_out is None else _rel(out, cudnn_out.transpose(1, 2).reshape(batch * chunk, HQ, D))
    prior = context - chunk
    flops = 4 * batch * HQ * D * (chunk * prior + chunk * (chunk + 1) / 2)
    cache = k = v = ke = ve = cudnn_out = q_eng = k_eng = v_eng = None  # frees the memory now (closures name it)
    return dict(
        batch=batch,
        chunk=chunk,
        context=context,
        cached_prefix=prior,
        block_size=block_size,
        path="dense (cuDNN over the step's K/V)" if dense is not None else "paged Triton kernel",
        paged_ms=round(paged_ms, 5),
        triton_ms=round(triton_ms, 5),
        triton_over_cudnn=cudnn_ms and round(triton_ms / cudnn_ms, 3),
        sdpa_ms=round(sdpa_ms, 5),
        paged_eager_ms=round(paged_eager_ms, 5),
        sdpa_backend_ms={n: (round(t, 5) if isinstance(t, float) else t) for n, t in per_backend.items()},
        sdpa_best_ms=round(_best(sdpa_ms, per_backend), 5),
        paged_over_sdpa=round(paged_ms / sdpa_ms, 3),
        paged_over_best_sdpa=round(paged_ms / _best(sdpa_ms, per_backend), 3),
        cudnn_ms=cudnn_ms and round(cudnn_ms, 5),
        cudnn_call=cudnn_how,
        prefill_over_cudnn=cudnn_ms and round(paged_ms / cudnn_ms, 3),
        paged_TFLOPs=round(flops / paged_ms / 1e9, 1),
        sdpa_TFLOPs=round(flops / sdpa_ms / 1e9, 1),
        cudnn_TFLOPs=cudnn_ms and round(flops / cudnn_ms / 1e9, 1),
        rel_err_vs_sdpa=err,
        rel_err_vs_cudnn=cudnn_err,
    )


# (batch, chunk, context): fresh 2,048-token chunks, then 512 and 8,192 after a 4,096-token cached prefix
PREFILL_SHAPES = (
    (1, 2048, 2048),
    (4, 2048, 2048),
    (1, 2048, 4096),
    (4, 2048, 4096),
    (1, 512, 4608),
    (4, 512, 4608),
    (1, 8192, 12288),
)


def sweep(copy: float) -> dict:
    """Tile configurations (decode at batch 64 x 4096, prefill at 4 x 2048) and decode split counts."""
    from kernels import paged_attention as pa

    out: dict = {"decode_tiles": [], "decode_splits": [], "prefill_tiles": []}
    scale = D**-0.5
    batch, context, bs = 64, 4096, 16
    cache, tables, query, seq_lens, qsl, k, v = paged_setup(batch, context, bs)
    k = v = None  # frees the memory now (a closure above still names it)
    moved = _decode_bytes_read(cache, query, tables, seq_lens, batch, context) + query.numel() * query.element_size()
    configs = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 2), (128, 4, 3), (128, 8, 3), (32, 4, 3)]
    for block_n, warps, stages in configs:
        for splits in (1, 2):
            cfg = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
            try:
                ms = _bench(
                    lambda: pa.paged_attention_decode(
                        query, cache, tables, seq_lens, scale, context, num_splits=splits, config=cfg
                    )
                )
                pct = round(100 * moved / (ms * 1e-3) / 1e12 / copy, 1)
                out["decode_tiles"].append(dict(cfg, num_splits=splits, paged_ms=round(ms, 5), pct_of_copy=pct))
                print("sweep decode", cfg, splits, round(ms, 4), pct, flush=True)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is just skipped
                out["decode_tiles"].append(dict(cfg, num_splits=splits, error=str(e)[:200]))
    cache = None  # frees the memory now (a closure above still names it)
    for batch, context in ((1, 8192), (4, 8192), (16, 8192), (16, 2048), (32, 4096)):
        cache, tables, query, seq_lens, qsl, k, v = paged_setup(batch, context, bs)
        k = v = None  # frees the memory now (a closure above still names it)
        moved = _decode_bytes_read(cache, query, tables, seq_lens, batch, context) + query.numel() * 2
        row = dict(batch=batch, context=context, heuristic=pa.num_decode_splits(batch, HKV, context, query.device))
        for splits in (1, 2, 4, 8, 16, 32, 64):
            ms = _bench(
                lambda: pa.paged_attention_decode(query, cache, tables, seq_lens, scale, context, num_splits=splits)
            )
            row[f"splits_{splits}_ms"] = round(ms, 5)
            row[f"splits_{splits}_pct_of_copy"] = round(100 * moved / (ms * 1e-3) / 1e12 / copy, 1)
        print("sweep splits", row, flush=True)
        out["decode_splits"].append(row)
        cache = None  # frees the memory now (a closure above still names it)
    batch, chunk = 4, 2048
    cache, tables, query, seq_lens, qsl, k, v = paged_setup(batch, chunk, bs, q_len=chunk)
    del k, v
    for bm, bn, warps, stages in (
        (128, 64, 8, 3),
        (128, 32, 4, 3),
        (128, 32, 4, 4),
        (128, 32, 4, 2),
        (128, 64, 4, 4),
        (128, 64, 4, 2),
        (64, 32, 4, 3),
        (64, 64, 4, 3),
        (64, 64, 4, 2),
        (128, 32, 8, 3),
        (128, 128, 8, 3),
        (128, 16, 4, 3),
    ):
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        try:
            ms = _bench(
                lambda: pa.paged_attention_prefill(query, cache, tables, seq_lens, qsl, scale, chunk, config=cfg)
            )
            out["prefill_tiles"].append(dict(cfg, paged_ms=round(ms, 5)))
            print("sweep prefill", cfg, round(ms, 4), flush=True)
        except Exception as e:  # noqa: BLE001
            out["prefill_tiles"].append(dict(cfg, error=str(e)[:200]))
    cache = None  # frees the memory now (a closure above still names it)
    return out


def prefill_tile_choice() -> list[dict]:
    """The paged prefill kernel's tiles where its grid is small (few sequences, short chunks after a long prefix),
    to check the automatic choice (`SMALL_GRID_CONFIG` below two waves of programs) against the alternatives."""
    from kernels import paged_attention as pa

    rows = []
    scale = D**-0.5
    for batch, chunk, context in ((1, 512, 4608), (2, 512, 4608), (4, 512, 4608), (1, 1024, 5120), (1, 2048, 4096)):
        cache, tables, query, seq_lens, qsl, _, _ = paged_setup(batch, context, 16, q_len=chunk)
        row: dict = dict(batch=batch, chunk=chunk, context=context)
        row["auto_ms"] = round(
            _bench(lambda: pa.paged_attention_prefill(query, cache, tables, seq_lens, qsl, scale, chunk)), 5
        )
        for bm, bn, warps, stages in ((128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 4, 2)):
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
            ms = _bench(
                lambda: pa.paged_attention_prefill(query, cache, tables, seq_lens, qsl, scale, chunk, config=cfg)
            )
            row[f"{bm}x{bn}_{warps}w{stages}s_ms"] = round(ms, 5)
        print("prefill tiles", row, flush=True)
        rows.append(row)
        cache = None
    return rows


def dense_threshold() -> list[dict]:
    """Fresh chunks of 512-3,072 tokens: the paged kernel against the dense path (the engine's entry point with
    the chunk listed as dense, as the runner lists the planned lengths), device time and eager time (which
    carries each path's host cost), to place `DENSE_PREFILL_MIN_TOKENS`."""
    from kernels import paged_attention as pa
    from kernels import triton_backend
    from kernels.dense_prefill import DenseChunks, runs_of

    rows = []
    scale = D**-0.5
    if triton_backend.dense_prefill_lengths(DTYPE, DTYPE, HQ, HKV, D, torch.device(DEVICE)) is None:
        return rows
    for batch in (1, 4):
        for chunk in (512, 1024, 1536, 2048, 3072):
            cache, tables, query, seq_lens, qsl, k, v = paged_setup(batch, chunk, 16, q_len=chunk)
            q_eng, k_eng, v_eng = _engine_layout(query, k, v, batch, chunk)
            dense = DenseChunks(runs_of([chunk] * batch, 0), batch, 0)

            def paged():
                return pa.paged_attention_prefill(query, cache, tables, seq_lens, qsl, scale, chunk)

            def dense_path():
                return triton_backend.paged_attention(
                    q_eng, cache, tables, seq_lens, qsl, scale, chunk, chunk, dense=dense, fresh_kv=(k_eng, v_eng)
                )

            row = dict(
                batch=batch,
                chunk=chunk,
                paged_ms=round(_bench(paged), 5),
                dense_ms=round(_bench(dense_path), 5),
                paged_eager_ms=round(_bench_eager(paged), 5),
                dense_eager_ms=round(_bench_eager(dense_path), 5),
            )
            print("dense threshold", row, flush=True)
            rows.append(row)
            cache = k = v = q_eng = k_eng = v_eng = None
    return rows


def cudnn_plan_cost() -> list[dict]:
    """cuDNN's attention builds an execution plan the first time it sees a shape: the wall time of that first
    call (synchronised) against the same call once planned, for shapes no earlier row used."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for batch, length in ((1, 1280), (1, 1536), (2, 1536), (1, 1792), (1, 3072), (3, 1280)):
        q = torch.randn(batch, HQ, length, D, device=DEVICE, dtype=DTYPE)
        k = torch.randn(batch, HKV, length, D, device=DEVICE, dtype=DTYPE)
        v = torch.randn_like(k)

        def call():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        first = (time.perf_counter() - t) * 1e3
        row = dict(
            batch=batch, length=length, first_call_ms=round(first, 3), planned_eager_ms=round(_bench_eager(call), 5)
        )
        print("cudnn plan", row, flush=True)
        rows.append(row)
    return rows


def host_overheads() -> dict:
    """Host microseconds per eager call, each on a shape whose device time is shorter."""
    import triton
    import triton.language as tl

    from kernels import triton_backend

    @triton.jit
    def _empty(x_ptr):
        pass

    x = torch.empty(1, device=DEVICE)
    out = {"empty_triton_kernel": host_overhead_us(lambda: _empty[(1,)](x))}
    del tl
    scale = D**-0.5
    for name, batch, context, q_len in (
        ("decode_one_kernel", 64, 64, 1),
        ("decode_split_two_kernels", 1, 512, 1),
        ("prefill", 1, 64, 64),
    ):
        cache, tables, query, seq_lens, qsl, k, v = paged_setup(batch, context, 16, q_len=q_len)
        out[name] = host_overhead_us(
            lambda: triton_backend.paged_attention(query, cache, tables, seq_lens, qsl, scale, q_len, context)
        )
        if name == "decode_one_kernel":
            q4 = query.view(batch, HQ, 1, D)
            out["sdpa_decode"] = host_overhead_us(
                lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
            )
            slots = torch.arange(batch, device=DEVICE)
            kk = torch.randn(batch, HKV, D, device=DEVICE, dtype=DTYPE)
            out["write_kv"] = host_overhead_us(lambda: triton_backend.write_kv(kk, kk, cache, slots))
    print("host overhead (us per call)", out, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="only the target rows")
    ap.add_argument("--sweep", action="store_true", help="also sweep tile configurations")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--no-decode", action="store_true", help="only the prefill rows")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from kernels import paged_attention as pa

    name = torch.cuda.get_device_name()
    copy = copy_tbps()
    print(f"{name}: device-to-device copy {copy:.3f} TB/s (read + write)", flush=True)
    result: dict = dict(
        gpu=name,
        date=_dt.date.today().isoformat(),
        torch=torch.__version__,
        triton=triton.__version__,
        dtype="bfloat16",
        num_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        timing=(
            "*_ms: median of 100 CUDA-graph replays timed with CUDA events, L2 flushed before each; "
            "*_eager_ms: triton.testing.do_bench median of eager calls (includes host launch cost when "
            "the kernel is shorter than it)"
        ),
        copy_TBps=round(copy, 4),
        decode_config_bs16=pa.decode_config(D, 16, DTYPE),
        prefill_config=pa.prefill_config(D, 16, DTYPE),
        decode=[],
        prefill=[],
    )
    if args.sweep:
        result["sweep"] = sweep(copy)
    result["host_overhead_us"] = host_overheads()

    shapes = [(b, c, 16) for b in (1, 16, 64, 256) for c in (512, 2048, 8192)]
    shapes += [(64, 4096, bs) for bs in (8, 16, 32)]
    if args.quick:
        shapes = [(64, 4096, bs) for bs in (8, 16, 32)]
    if args.no_decode:
        shapes = []
    for batch, context, bs in shapes:
        r = decode_row(batch, context, bs, copy)
        result["decode"].append(r)
        print(
            f"decode b={batch:4d} ctx={context:5d} bs={bs:2d}: paged {r['paged_ms']:.4f} ms, "
            f"sdpa {r['contiguous_ms']:.4f} ms ({r['paged_over_contiguous']:.2f}x), eager "
            f"{r['paged_eager_ms']:.4f}/{r['contiguous_eager_ms']:.4f} ms, "
            f"{r['achieved_TBps']:.3f} TB/s = {r['pct_of_copy']:.1f}% of copy, splits {r['num_splits']}, "
            f"err {r['rel_err_vs_sdpa']:.1e}",
            flush=True,
        )
        torch.cuda.empty_cache()
    if not args.no_prefill:
        for batch, chunk, context in PREFILL_SHAPES:
            r = prefill_row(batch, chunk, context, 16)
            result["prefill"].append(r)
            print(
                f"prefill b={batch} chunk={chunk} ctx={context}: paged {r['paged_ms']:.3f} ms "
                f"({r['paged_TFLOPs']} TFLOP/s), sdpa {r['sdpa_ms']:.3f} ms ({r['sdpa_TFLOPs']} TFLOP/s), "
                f"{r['paged_over_sdpa']:.2f}x, cudnn {r['cudnn_ms']} ms ({r['prefill_over_cudnn']}x, "
                f"{r['cudnn_call']}), err {r['rel_err_vs_sdpa']:.1e}",
                flush=True,
            )
            torch.cuda.empty_cache()
        result["prefill_tile_choice"] = prefill_tile_choice()
        result["dense_threshold"] = dense_threshold()
        result["cudnn_plan_cost"] = cudnn_plan_cost()

    key = next((r for r in result["decode"] if (r["batch"], r["context"], r["block_size"]) == (64, 4096, 16)), None)
    fresh = [r for r in result["prefill"] if r["chunk"] == r["context"]]
    result["graph_capture_fallbacks"] = EAGER_FALLBACKS
    result["targets"] = dict(
        decode_b64_ctx4096_pct_of_copy=key and key["pct_of_copy"],
        decode_b64_ctx4096_ge_80pct_of_copy=key and key["pct_of_copy"] >= 80.0,
        decode_b64_ctx4096_paged_over_contiguous=key and key["paged_over_contiguous"],
        decode_b64_ctx4096_le_1_10x_contiguous=key and key["paged_over_contiguous"] <= 1.10,
        decode_b64_ctx4096_paged_over_best_contiguous=key and key["paged_over_best_contiguous"],
        prefill_2048_paged_over_sdpa=[r["paged_over_sdpa"] for r in fresh],
        prefill_2048_le_1_25x_sdpa=bool(fresh) and all(r["paged_over_sdpa"] <= 1.25 for r in fresh),
        prefill_2048_paged_over_best_sdpa=[r["paged_over_best_sdpa"] for r in fresh],
        prefill_over_cudnn={
            f"{r['batch']}x{r['chunk']}+{r['cached_prefix']}": r["prefill_over_cudnn"] for r in result["prefill"]
        },
        prefill_le_1_10x_cudnn=bool(result["prefill"])
        and all(r["prefill_over_cudnn"] is not None and r["prefill_over_cudnn"] <= 1.10 for r in result["prefill"]),
    )
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"kernels-{gpu_slug(name)}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["targets"], indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
