"""Two CPU engines decoding at once on the same cores, at chosen thread counts: what an overlapping handover costs.

    python -m benchmarks.cpu_pair_contention [--model DIR] [--dtype float32] [--batch 4] [--steps 200]
                                             [--pairs 2+2,2+1,1+1] [--alone 2,1] [--repeats 1]
                                             [--out benchmarks/results] [--quick]

During opsctl's overlapping restart the new engine serves while the old one drains, both on one machine's cores.
Each process here loads the engine (`LLM`, prefix caching off), warms up, and reports ready; when both are ready the
parent starts them together, and each times greedy decode of `--batch` sequences for `--steps` tokens
(ignore_eos): milliseconds per step.  `--alone` runs one process at a time for the baseline.  A pair `A+B` runs
one engine with A model threads beside one with B (`engine/core_share.py` uses half each: 1+1 on 2 cores).

The JSON result goes to `<out>/cpu-pair-contention-<YYYY-MM-DD>.json` with the CPU model, the core count and the
command line.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 16


def worker(model: str | None, dtype: str, threads: int, batch: int, steps: int) -> None:
    """Load, warm up, print "ready", wait for a line on stdin, decode, print the result as JSON."""
    import random

    import torch

    torch.set_num_threads(threads)
    from engine import LLM, SamplingParams

    kwargs: dict[str, Any] = {"dtype": dtype, "enable_prefix_caching": False, "kv_cache_memory_bytes": 256 << 20}
    llm = LLM(model, **kwargs) if model else LLM(**kwargs)
    vocab = llm.llm_engine.limits.vocab_size
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, min(vocab, 30000)) for _ in range(PROMPT_TOKENS)]} for _ in range(batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == steps for o in outs)
    print(json.dumps({"threads": torch.get_num_threads(), "ms_per_step": round(seconds / steps * 1e3, 3)}), flush=True)


def run_together(args: argparse.Namespace, threads: list[int]) -> list[dict[str, Any]]:
    """Start one worker per entry, wait until all are ready, release them at once, collect their results."""
    cmd = [sys.executable, "-m", "benchmarks.cpu_pair_contention", "--worker", "--dtype", args.dtype]
    cmd += ["--batch", str(args.batch), "--steps", str(args.steps)] + (["--model", args.model] if args.model else [])
    procs = [
        subprocess.Popen(
            [*cmd, "--threads", str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        )
        for n in threads
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"a worker did not get ready (exit {p.wait()}): {line!r}")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            assert p.stdout is not None
            results.append(json.loads(p.stdout.readline()))
            p.wait(60)
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _thread_counts(text: str, sep: str) -> list[list[int]]:
    """`2+2,2+1` -> [[2, 2], [2, 1]] (sep "+"); `2,1` -> [[2], [1]] (sep ""): a bad entry is an argparse error."""
    try:
        groups = [[int(n) for n in (item.split(sep) if sep else [item])] for item in text.split(",") if item]
    except ValueError as e:
        joined = f" joined by {sep}" if sep else ""
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated thread counts{joined}") from e
    if any(n < 1 for g in groups for n in g):
        raise argparse.ArgumentTypeError(f"{text!r}: thread counts must be at least 1")
    return groups


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument(
        "--pairs",
        default="2+2,2+1,1+1",
        type=lambda t: _thread_counts(t, "+"),
        help="thread counts of the two engines, comma-separated",
    )
    ap.add_argument(
        "--alone", default="2,1", type=lambda t: _thread_counts(t, ""), help="thread counts to time one engine alone"
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 16 steps, pair 1+1, alone 1, no file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.model, args.dtype, args.threads, args.batch, args.steps)
        return 0
    if args.quick:
        args.steps, args.pairs, args.alone = 16, [[1, 1]], [[1]]
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for (n,) in args.alone:
            (one,) = run_together(args, [n])
            rows.append({"run": f"alone {n}", "repeat": repeat, "engines": [one]})
            print(f"alone, {n} thread(s): {one['ms_per_step']} ms/step", flush=True)
        for threads in args.pairs:
            pair = "+".join(map(str, threads))
            both = run_together(args, threads)
            rows.append({"run": f"pair {pair}", "repeat": repeat, "engines": both})
            shown = " / ".join(f"{e['ms_per_step']} ({e['threads']} thr)" for e in both)
            print(f"pair {pair}: {shown} ms/step", flush=True)
    result = {
        "benchmark": "cpu_pair_contention",
        "date": _dt.date.today().isoformat(),
        "command": shlex.join([sys.executable, "-m", "benchmarks.cpu_pair_contention", *(argv or sys.argv[1:])]),
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "model": args.model or "embedded default",
        "dtype": args.dtype,
        "batch": args.batch,
        "steps": args.steps,
        "rows": rows,
    }
    if not args.quick:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"cpu-pair-contention-{result['date']}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    else:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
