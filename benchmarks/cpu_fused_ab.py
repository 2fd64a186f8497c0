"""The CPU's compiled operations against what they replace, in one engine: the small operations (kernels/cpu_fused.py)
or the few-row linear product (kernels/cpu_linear.py).

    python3 -m benchmarks.cpu_fused_ab --model DIR [--feature fused|linear] [--dtype float32]
                                       [--num-seqs 1,4,16,64] [--repeats 3] [--in-tokens 128] [--out-tokens 64]
                                       [--out FILE]

One process, one engine (`LLM`, prefix caching off, greedy, `ignore_eos`): for each batch size the two arms
alternate. `--feature fused` (the default): `compiled` (RMSNorm, SiLU-and-multiply, rotary and the KV write as
kernels/csrc/cpu_fused.cpp's operations) and `torch` (the same calls routed to kernels/reference.py and the torch KV
write, as before 2026-11-28). `--feature linear`: `panels` (products of up to 16 rows over the panel copy) and
`onednn` (every product on oneDNN's packed weight, as before 2026-11-29). Everything else is the same in both arms.
Each sample is one `generate` of N
prompts of random token ids, after one untimed call of the same; the figure is output tokens per second (prefill
included, as benchmarks/peer_vllm_cpu.py's offline figure), the median over repeats, and every sample is kept. The
greedy tokens of the two arms are compared and the share of sequences that match throughout is recorded (float32:
they may part at a near-tie, since the RMS is summed in another order).
Results: `benchmarks/results/cpu-<feature>-ab-<date>.json` unless --out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.cpu_pair_contention import cpu_model

REPO = Path(__file__).resolve().parent.parent
ARMS = ("compiled", "torch")  # --feature fused: the compiled operations, then what they replace
LINEAR_ARMS = ("panels", "onednn")  # --feature linear


@contextlib.contextmanager
def torch_ops() -> Iterator[None]:
    """The reference operations in place of the compiled ones (a benchmark-only override, undone on exit)."""
    from kernels import cpu_fused

    saved = {name: getattr(cpu_fused, name) for name in ("_compiled", "handles_rotary", "write_kv")}
    cpu_fused._compiled = lambda x: False  # type: ignore[assignment]
    cpu_fused.handles_rotary = lambda *a: False  # type: ignore[assignment]
    cpu_fused.write_kv = lambda *a: False  # type: ignore[assignment]
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(cpu_fused, name, value)


@contextlib.contextmanager
def onednn_only() -> Iterator[None]:
    """Every packed product on oneDNN's weight, none over the panel copy (a benchmark-only override, undone)."""
    import torch

    from engine.model import cpu_packing

    saved = cpu_packing._PackedProduct.__call__

    def onednn(self: cpu_packing._PackedProduct, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    cpu_packing._PackedProduct.__call__ = onednn  # type: ignore[method-assign]
    try:
        yield
    finally:
        cpu_packing._PackedProduct.__call__ = saved  # type: ignore[method-assign]


FEATURES = {"fused": (ARMS, torch_ops), "linear": (LINEAR_ARMS, onednn_only)}


def _prompts(n: int, length: int, seed: int, vocab: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    top = min(vocab, 30000)
    return [{"prompt_token_ids": [rng.randrange(min(100, top // 2), top) for _ in range(length)]} for _ in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine import LLM, SamplingParams
    from kernels import cpu_ext, cpu_linear

    if cpu_ext.unavailable_reason() is not None:
        raise SystemExit(f"the CPU extension is not loaded: {cpu_ext.unavailable_reason()}")
    if args.feature == "linear" and not cpu_linear.available():
        raise SystemExit("the few-row product is not offered here (AVX-512 only, PAGEKEEPER_CPU_DECODE_WEIGHTS=auto)")
    arms, baseline = FEATURES[args.feature]
    ratio = f"{arms[0]}_over_{arms[1]}"
    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_memory_bytes=2 << 30,
        enable_prefix_caching=False,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=args.in_tokens + args.out_tokens + 16,
    )
    params = SamplingParams(temperature=0, max_tokens=args.out_tokens, ignore_eos=True)
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    warm = _prompts(4, args.in_tokens, 1, vocab)
    rows: list[dict[str, Any]] = []
    for n in args.num_seqs:
        prompts = _prompts(n, args.in_tokens, 0, vocab)
        samples: dict[str, list[float]] = {arm: [] for arm in arms}
        tokens: dict[str, list[list[int]]] = {}
        llm.generate(prompts, params, use_tqdm=False)  # untimed: the first call at a new batch shape is slower
        for rep in range(args.repeats):
            for arm in arms if rep % 2 == 0 else arms[::-1]:  # alternate which arm goes first
                with baseline() if arm == arms[1] else contextlib.nullcontext():
                    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
                    started = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    took = time.perf_counter() - started
                made = sum(len(o.outputs[0].token_ids) for o in outs)
                samples[arm].append(made / took)
                tokens.setdefault(arm, [list(o.outputs[0].token_ids) for o in outs])
        med = {arm: statistics.median(v) for arm, v in samples.items()}
        same = sum(a == b for a, b in zip(tokens[arms[0]], tokens[arms[1]], strict=True)) / n
        row = {"num_seqs": n, "out_tok_s": med, "samples": samples, ratio: med[arms[0]] / med[arms[1]]}
        row["greedy_same_share"] = same
        rows.append(row)
        print(f"N={n}: {arms[0]} {med[arms[0]]:.1f} tok/s, {arms[1]} {med[arms[1]]:.1f} ({row[ratio]:.3f}x)")
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.cpu_fused_ab", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--feature", default="fused", choices=tuple(FEATURES), help="what the two arms compare")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--num-seqs", default="1,4,16,64", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--in-tokens", type=int, default=128)
    p.add_argument("--out-tokens", type=int, default=64)
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/cpu-fused-ab-<date>.json)")
    args = p.parse_args(argv)
    if args.repeats < 1 or any(n < 1 for n in args.num_seqs):
        p.error("--repeats and every --num-seqs value must be at least 1")
    import torch

    date = _dt.date.today().isoformat()
    result = {
        "command": "python3 -m benchmarks.cpu_fused_ab " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": date,
        "cpu_model": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "feature": args.feature,
        "model": Path(args.model).name,
        "dtype": args.dtype,
        "in_tokens": args.in_tokens,
        "out_tokens": args.out_tokens,
        "repeats": args.repeats,
        **run(args),
    }
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"cpu-{args.feature}-ab-{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
