"""Would a mixed step gain from running its decode attention beside its projections? (GPU)

    python -m benchmarks.overlap_probe [--out DIR]

A mixed step of the long-tailed workload (~250 decodes + one ~340-token prompt, Llama-3-8B shape) is
compute-bound in its projections and bandwidth-bound in its decodes' attention; each layer runs them one after
the other, so the step costs about their sum, while the schedule-aware bound charges their max.  Overlap (two
halves of the step on two streams, one half's attention under the other's GEMMs) only pays if the GPU runs a
GEMM and the attention kernel side by side faster than one after the other.  This measures exactly that, for
one layer's four projections at M tokens and the decode attention over B contexts drawn from the workload's
lognormal, repeated over 32 layers' worth of distinct weights:

- `gemm_ms`, `attention_ms`: each alone on one stream;
- `serial_ms`: both on one stream; `overlapped_ms`: the GEMMs on one stream, the attention on another;
- per-projection TFLOP/s at each M against the n x n x n matmul rate.

JSON: `<out>/overlap-probe-<gpu>-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch

from benchmarks.kernels import gpu_slug
from benchmarks.throughput import RESULTS, copy_bandwidth, matmul_rate

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4096, 14336, 32, 8, 128, 32
PROJECTIONS = {
    "qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTER),
    "down": (INTER, HIDDEN),
}


def _time(fn, reps: int = 10) -> float:
    """Median milliseconds of fn() over `reps` runs (after one warm-up)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m-step", type=int, default=0, help="the projections' curve every N tokens from 128 to 1,024")
    p.add_argument("--gemm-only", action="store_true", help="the projections' curve only")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.m_step < 0 or args.m_step > 896:
        p.error(f"--m-step must be between 0 (the default counts) and 896, not {args.m_step}")
    if not torch.cuda.is_available():
        print("benchmarks.overlap_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    from kernels.paged_attention import paged_attention_decode

    dev, dt_ = torch.device("cuda"), torch.bfloat16
    matmul = matmul_rate(dev, 8192, dt_)
    copy = copy_bandwidth(dev, 2 << 30)
    gen = torch.Generator().manual_seed(0)
    # 4 layers of distinct weights, cycled 8 times: 32 layers' worth of launches, weights larger than the L2
    weights = [
        {k: torch.randn(n, k_, device=dev, dtype=dt_) * 0.02 for k, (k_, n) in PROJECTIONS.items()} for _ in range(4)
    ]
    x_in = torch.randn(2048, INTER, device=dev, dtype=dt_)

    def gemms(m: int):
        def run():
            for i in range(LAYERS):
                w = weights[i % 4]
                for name, (k, _) in PROJECTIONS.items():
                    torch.matmul(x_in[:m, :k], w[name].t())

        return run

    rows = []
    ms_list = range(128, 1025, args.m_step) if args.m_step else (128, 256, 320, 384, 512, 576, 640, 768, 896, 1024)
    for m in ms_list:
        ms = _time(gemms(m))
        flops = LAYERS * sum(2 * m * k * n for k, n in PROJECTIONS.values())
        wbytes = LAYERS * sum(2 * k * n for k, n in PROJECTIONS.values())
        floor = max(flops / matmul, wbytes / copy) * 1e3
        rows.append(
            dict(
                m=m,
                ms=round(ms, 3),
                tflops=round(flops / ms / 1e9, 1),
                floor_ms=round(floor, 3),
                efficiency=round(floor / ms, 3),
            )
        )
        print(rows[-1])

    if args.gemm_only:
        batches: tuple[int, ...] = ()
    else:
        batches = (128, 256)
    # decode attention: B contexts from the long-tailed workload's shape (lognormal, median ~400, up to 3,072)
    block = 16
    results = []
    for batch in batches:
        lens = torch.exp(torch.randn(batch, generator=gen) * 0.9 + 6.0).clamp(16, 3072).long()
        blocks_per = (lens + block - 1) // block
        total_blocks = int(blocks_per.sum())
        cache = torch.randn(2, total_blocks + 1, KV_HEADS, block, HEAD_DIM, device=dev, dtype=dt_) * 0.1
        width = int(blocks_per.max())
        table = torch.zeros(batch, width, dtype=torch.int32)
        nxt = 1
        for b in range(batch):
            n = int(blocks_per[b])
            table[b, :n] = torch.arange(nxt, nxt + n)
            nxt += n
        table, seq_lens = table.to(dev), lens.to(dev, torch.int32)
        q = torch.randn(batch, HEADS, HEAD_DIM, device=dev, dtype=dt_)
        out = torch.empty_like(q)
        max_len = int(lens.max())

        def attention():
            for _ in range(LAYERS):
                paged_attention_decode(q, cache, table, seq_lens, HEAD_DIM**-0.5, max_len, out=out, num_splits=1)

        kv_bytes = LAYERS * int(lens.sum()) * 2 * KV_HEADS * HEAD_DIM * 2
        attn_ms = _time(attention)
        side = torch.cuda.Stream()
        for m in (256, 384, 512, 640):
            g = gemms(m)
            gemm_ms = _time(g)

            def serial():
                g()
                attention()

            def overlapped():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    attention()
                g()
                torch.cuda.current_stream().wait_stream(side)

            row = dict(
                decodes=batch,
                context_mean=round(float(lens.float().mean()), 1),
                m=m,
                gemm_ms=round(gemm_ms, 3),
                attention_ms=round(attn_ms, 3),
                attention_bandwidth_fraction=round(kv_bytes / copy / (attn_ms / 1e3), 3),
                serial_ms=round(_time(serial), 3),
                overlapped_ms=round(_time(overlapped), 3),
            )
            row["overlap_saving"] = round(1 - row["overlapped_ms"] / row["serial_ms"], 3)
            results.append(row)
            print(row)

    name = torch.cuda.get_device_name()
    result = dict(
        gpu=name,
        date=dt.date.today().isoformat(),
        command="python -m benchmarks.overlap_probe " + " ".join(sys.argv[1:] if argv is None else argv),
        matmul_TFLOPs=round(matmul / 1e12, 1),
        copy_TBps=round(copy / 1e12, 3),
        projections_by_m=rows,
        overlap=results,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    variant = "-gemm" if args.gemm_only else ""
    path = args.out / f"overlap-probe-{gpu_slug(name)}{variant}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
