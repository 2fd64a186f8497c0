"""The dense path for fresh chunks on the CPU, A/B in one process (kernels/dense_prefill.py).

    python3 -m benchmarks.dense_ab_cpu [--size 512x8] [--num-seqs 256] [--dtype bfloat16] [--out DIR]

The peer benchmark's random-weight Llama checkpoint and prompts (benchmarks/peer_vllm_cpu.py: 128 tokens in,
greedy, no EOS), one engine; the runner's `dense_lengths` is switched between the CPU backend's (every fresh
chunk attends over the step's own K/V) and None (every chunk read back from the paged cache), alternating,
twice each: a prefill-only pass (max_tokens 1) and a full generate (128 out).  Seconds per pass go to
`<out>/dense-ab-cpu-<size>-<dtype>-n<N>-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.peer_vllm_cpu import ENGINE, KV_GIB, OUT_TOKENS, _prompts, make_checkpoint
from benchmarks.throughput import RESULTS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="512x8", help="hidden x layers")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    from engine import LLM, SamplingParams

    hidden, layers = map(int, args.size.split("x"))
    model = make_checkpoint(hidden, layers, Path(tempfile.gettempdir()) / "pagekeeper-peer")
    llm = LLM(str(model), dtype=args.dtype, kv_cache_memory_bytes=KV_GIB << 30, enable_prefix_caching=False, **ENGINE)
    prompts = [{"prompt_token_ids": q} for q in _prompts(args.num_seqs)]
    runner = llm.llm_engine.core.runner
    dense = runner.dense_lengths
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    runs = []
    for label in ("dense", "paged", "dense", "paged"):
        runner.dense_lengths = dense if label == "dense" else None
        for max_tokens in (1, OUT_TOKENS):
            t = time.monotonic()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
            runs.append(dict(path=label, max_tokens=max_tokens, seconds=round(time.monotonic() - t, 3)))
            print(runs[-1], flush=True)
    result = dict(
        date=dt.date.today().isoformat(),
        command="python3 -m benchmarks.dense_ab_cpu " + " ".join(sys.argv[1:] if argv is None else argv),
        size=args.size,
        dtype=args.dtype,
        num_seqs=args.num_seqs,
        runs=runs,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"dense-ab-cpu-{args.size}-{args.dtype}-n{args.num_seqs}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
