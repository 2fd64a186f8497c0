"""Memory benchmark (issue 5): token-slot utilization, concurrency vs contiguous preallocation,
a burst past capacity, a soak for allocator growth, and the start-up fragmentation buffer.

    python -m benchmarks.memory                 # GPU: random-weight Llama-3-8B shape, bf16
    python -m benchmarks.memory --quick         # CPU smoke run on the embedded model

Writes benchmarks/results/memory-<gpu>-<date>.json (keys listed in the issue).  Random weights come
from load_format="dummy"; prompts are token ids, so no tokenizer matters.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.default_model import DEFAULT_MODEL_DIR
from engine.kv.kv_cache_manager import blocks_for_tokens

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def model_dir(quick: bool) -> str:
    if quick:
        return str(DEFAULT_MODEL_DIR)
    d = Path(tempfile.mkdtemp(prefix="llama3-8b-shape-"))
    # The embedded tokenizer comes along, so BOS/EOS are its ids: a grammar engine (structured outputs)
    # refuses an EOS outside the tokenizer's vocabulary.
    own = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    cfg = {**LLAMA3_8B, "bos_token_id": own["bos_token_id"], "eos_token_id": own["eos_token_id"]}
    (d / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, d / name)
    return str(d)


def long_tailed(rng: random.Random, n: int, median: float, sigma: float, lo: int, hi: int) -> list[int]:
    """Lognormal lengths: most short, a long tail (as real traffic)."""
    return [max(lo, min(hi, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def workload(rng: random.Random, n: int, max_len: int, vocab: int, scale: float) -> list[tuple[list[int], int]]:
    prompts = long_tailed(rng, n, 180 * scale, 0.9, 4, max_len // 2)
    outputs = long_tailed(rng, n, 120 * scale, 0.8, 2, max_len // 2)
    return [([rng.randrange(10, vocab) for _ in range(p)], o) for p, o in zip(prompts, outputs)]


def release() -> None:
    """Return a finished engine's memory to the device (callers drop every reference first), so
    the next engine's start-up budget sees it free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_utilization(
    model: str, common: dict, block_size: int, reqs: list[tuple[list[int], int]], bar: Any
) -> dict[str, Any]:
    """Run the workload; token utilization is averaged over steps (tokens stored / slots held)."""
    llm = LLM(model, block_size=block_size, **common)
    engine = llm.llm_engine
    core = engine.core
    for i, (ids, out) in enumerate(reqs):
        engine.add_request(
            str(i), {"prompt_token_ids": ids}, SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
        )
    samples, peak_running, done = [], 0, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            done += o.finished
        if core.scheduler.num_running:
            samples.append(core.token_utilization())
        peak_running = max(peak_running, core.scheduler.num_running)
        bar(f"block {block_size}: {done}/{len(reqs)}")
    result = {
        "token_utilization": sum(samples) / len(samples),
        "peak_running": peak_running,
        "num_blocks": core.kv.num_blocks,
        "kv_bytes": core.kv_plan.kv_bytes,
        "bytes_per_token": core.kv_plan.bytes_per_block // block_size,
        "preemptions": core.scheduler.num_preemptions,
        "fragmentation_buffer_bytes": core.kv_plan.fragmentation_buffer_bytes,
        "profile_peak_reserved_bytes": core.kv_plan.profile.peak_reserved_bytes if core.kv_plan.profile else 0,
        "profile_peak_allocated_bytes": core.kv_plan.profile.peak_allocated_bytes if core.kv_plan.profile else 0,
        "memory_plan": core.kv_plan.table(),
    }
    llm = engine = core = None  # frees the memory now (a closure above still names it)
    release()
    return result


def run_burst(model: str, common: dict, max_len: int, vocab: int, bar: Any) -> dict[str, Any]:
    """2x the KV capacity of max-length prompts, all at once: they must all complete, no OOM."""
    llm = LLM(model, block_size=16, **common)
    engine = llm.llm_engine
    capacity = engine.core.kv.num_blocks // blocks_for_tokens(max_len, 16)
    n = 2 * capacity
    rng = random.Random(2)
    for i in range(n):
        engine.add_request(
            f"b{i}",
            {"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(max_len - 1)]},
            SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        )
    completed = ooms = 0
    while engine.has_unfinished_requests():
        try:
            completed += sum(o.finished for o in engine.step())
        except torch.cuda.OutOfMemoryError:
            ooms += 1
            break
        bar(f"burst: {completed}/{n}")
    llm = engine = None  # frees the memory now (a closure above still names it)
    release()
    return {
        "burst_capacity_sequences": capacity,
        "burst_requests": n,
        "burst_completed": completed,
        "burst_oom_count": ooms,
    }


def run_soak(
    model: str, common: dict, seconds: float, max_len: int, vocab: int, in_flight: int, scale: float, bar: Any
) -> dict[str, Any]:
    """Mixed traffic for `seconds` after a warm-up; reserved memory must not grow."""
    llm = LLM(model, block_size=16, **common)
    engine = llm.llm_engine
    rng = random.Random(3)
    cuda = torch.cuda.is_available()
    counter = 0
    timeline: list[dict[str, float]] = []

    def top_up() -> None:
        nonlocal counter
        while engine.num_unfinished_requests() < in_flight:
            ((ids, out),) = workload(rng, 1, max_len, vocab, scale)
            engine.add_request(
                f"s{counter}",
                {"prompt_token_ids": ids},
                SamplingParams(max_tokens=out, temperature=0.8, ignore_eos=True),
            )
            counter += 1

    warm_until = time.monotonic() + min(30.0, seconds / 4)
    while time.monotonic() < warm_until:
        top_up()
        engine.step()
    reserved0 = torch.cuda.memory_reserved() if cuda else 0
    start = time.monotonic()
    last_sample = 0.0
    while time.monotonic() - start < seconds:
        top_up()
        engine.step()
        t = time.monotonic() - start
        if t - last_sample >= 5 or not timeline:
            last_sample = t
            alloc = torch.cuda.memory_allocated() if cuda else 0
            res = torch.cuda.memory_reserved() if cuda else 0
            timeline.append(
                {
                    "t": round(t, 1),
                    "allocated": alloc,
                    "reserved": res,
                    "efficiency": round(alloc / res, 4) if res else 1.0,
                }
            )
            bar(f"soak: {t:.0f}/{seconds:.0f}s, {counter} requests")
    reserved1 = torch.cuda.memory_reserved() if cuda else 0
    max_reserved = max((p["reserved"] for p in timeline), default=0)
    llm = engine = None  # frees the memory now (a closure above still names it)
    release()
    return {
        "soak_seconds": seconds,
        "soak_requests": counter,
        "soak_reserved_growth_bytes": reserved1 - reserved0,
        "soak_max_reserved_growth_bytes": max_reserved - reserved0,
        "soak_timeline": timeline,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run on the embedded model")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--soak-seconds", type=float, default=600.0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument(
        "--burst-gpu-memory-utilization",
        type=float,
        default=0.3,
        help="a smaller budget for the burst, so that 2x capacity stays quick to run",
    )
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)

    quick = args.quick
    model = model_dir(quick)
    max_len = 256 if quick else args.max_model_len
    scale = 0.1 if quick else 1.0
    vocab = 384 if quick else LLAMA3_8B["vocab_size"]
    n = 40 if quick else args.requests
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    base: dict[str, Any] = dict(max_model_len=max_len, max_num_seqs=1024, enable_chunked_prefill=True)
    if quick:
        base.update(kv_cache_memory_bytes=64 * 32768)
    else:
        base.update(
            load_format="dummy",
            dtype="bfloat16",
            max_num_batched_tokens=8192,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )

    def bar(msg: str) -> None:
        print(f"\r  {msg:<60}", end="", file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "gpu": gpu,
        "date": dt.date.today().isoformat(),
        "quick": quick,
        "torch": torch.__version__,
        "command": "python -m benchmarks.memory " + " ".join(argv or sys.argv[1:]),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "cpu" if gpu == "cpu" else gpu.replace("NVIDIA ", "").replace(" ", "-")
    path = out / f"memory-{name}-{result['date']}.json"

    def save(phase: str) -> None:
        """Written after every phase, so a run cut short still reports what it measured."""
        result["completed_phases"] = result.get("completed_phases", []) + [phase]
        path.write_text(json.dumps(result, indent=2))

    rng = random.Random(1)
    reqs = workload(rng, n, max_len, vocab, scale)
    result["workload"] = {
        "requests": n,
        "mean_prompt_tokens": sum(len(p) for p, _ in reqs) / n,
        "mean_output_tokens": sum(o for _, o in reqs) / n,
    }

    util: dict[str, float] = {}
    for bs in (8, 16, 32):
        r = run_utilization(model, base, bs, reqs, bar)
        util[str(bs)] = round(r["token_utilization"], 4)
        result["token_utilization"] = util
        result.setdefault("utilization_runs", {})[str(bs)] = r
        save(f"utilization-{bs}")
        if bs == 16:
            b16 = r
    mean_blocks = sum(blocks_for_tokens(len(p) + o, 16) for p, o in reqs) / n
    paged = b16["num_blocks"] / mean_blocks
    contiguous = b16["kv_bytes"] / (max_len * b16["bytes_per_token"])
    result.update(
        {
            k: b16[k]
            for k in (
                "fragmentation_buffer_bytes",
                "profile_peak_reserved_bytes",
                "profile_peak_allocated_bytes",
                "memory_plan",
            )
        }
    )
    result.update(
        paged_sequences_fit=round(paged, 1),
        contiguous_sequences_fit=round(contiguous, 1),
        concurrency_ratio=round(paged / contiguous, 2),
        peak_running_observed=b16["peak_running"],
    )
    save("concurrency")

    burst_common = dict(base)
    if not quick:
        burst_common["gpu_memory_utilization"] = args.burst_gpu_memory_utilization
    result.update(run_burst(model, burst_common, max_len, vocab, bar))
    save("burst")
    result.update(run_soak(model, base, 5.0 if quick else args.soak_seconds, max_len, vocab, 64, scale, bar))
    save("soak")
    print(file=sys.stderr)
    for k in (
        "token_utilization",
        "concurrency_ratio",
        "burst_requests",
        "burst_completed",
        "burst_oom_count",
        "soak_seconds",
        "soak_reserved_growth_bytes",
        "fragmentation_buffer_bytes",
        "profile_peak_reserved_bytes",
        "profile_peak_allocated_bytes",
    ):
        print(f"{k:32} {result[k]}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
