"""Tensor parallelism on GPUs (issue 19): correctness and throughput at TP = 1, 2, 4, and the roofline.

    python -m benchmarks.tensor_parallel --tp 1 2            # Llama-3-8B shape, bf16, random weights
    python -m benchmarks.tensor_parallel --shape 70b --tp 4  # Llama-3.1-70B shape
    python -m benchmarks.tensor_parallel --quick --tp 1 2    # CPU smoke run (gloo) on the embedded model

For each size: the throughput benchmark's workload (256 prompts x 512 tokens in, 256 out, greedy,
no EOS), the engine's memory plan of every rank, and the greedy tokens of 32 check prompts
(64 tokens each), compared with the first size's: bf16 all-reduces sum in another order than one
GPU's matmul, so a rare near-tie may flip a token, and the flip rate is reported.  Random weights
(load_format=dummy) are drawn per checkpoint tensor from a generator seeded by its name, so every
size serves the same model.  The roofline per size adds the measured time of the forward pass's
all-reduces (2 per layer + the embedding's, at the step's token count: benchmarks/allreduce.py) to
the single-GPU roofline split over the ranks.  Writes benchmarks/results/tp-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.memory import LLAMA3_8B, model_dir
from benchmarks.throughput import _free, _sync, copy_bandwidth, matmul_rate, prompts_for, roofline_seconds
from engine import LLM, SamplingParams
from engine.memory.budget import ranks_table

RESULTS = Path(__file__).resolve().parent / "results"

LLAMA31_70B = {
    **LLAMA3_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


def shape_dir(shape: str, quick: bool) -> tuple[str, dict[str, Any]]:
    path = model_dir(quick)
    if quick:
        return path, json.loads((Path(path) / "config.json").read_text())
    cfg = LLAMA3_8B if shape == "8b" else LLAMA31_70B
    (Path(path) / "config.json").write_text(json.dumps(cfg))
    return path, cfg


def tp_roofline(
    cfg: dict[str, Any], tp: int, args: argparse.Namespace, ceilings: dict[str, float], allreduce: dict[str, Any]
) -> dict[str, float]:
    """The single-GPU roofline with the work split over `tp` GPUs, plus the all-reduces' measured time."""
    one = roofline_seconds(
        cfg,
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.max_num_seqs,
        2,
        ceilings["matmul_flops"],
        ceilings["copy_bytes_per_s"],
    )
    per_forward = 2 * cfg["num_hidden_layers"] + 1
    comm = 0.0
    if tp > 1:
        decode_t = allreduce[str(args.max_num_seqs * cfg["hidden_size"] * 2)]["seconds"]
        chunk_t = allreduce[str(args.max_num_batched_tokens * cfg["hidden_size"] * 2)]["seconds"]
        waves = -(-args.num_prompts // args.max_num_seqs)
        decode_steps = waves * (args.output_len - 1)
        prefill_steps = -(-args.num_prompts * args.input_len // args.max_num_batched_tokens)
        comm = per_forward * (decode_steps * decode_t + prefill_steps * chunk_t)
    compute = one["total_s"] / tp
    return {"compute_s": compute, "allreduce_s": comm, "total_s": compute + comm}


def run_size(
    model: str, cfg: dict[str, Any], tp: int, args: argparse.Namespace, engine_args: dict[str, Any]
) -> tuple[dict[str, Any], list[list[int]]]:
    t = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, **engine_args)
    cold = time.perf_counter() - t
    try:
        result, tokens = _measure(llm, cfg, args)
    finally:
        llm.close()
        del llm  # the engine's memory goes back to the device before the next size starts
        _free()
    return {"tp": tp, "cold_start_s": round(cold, 1), **result}, tokens


def _measure(llm: LLM, cfg: dict[str, Any], args: argparse.Namespace) -> tuple[dict[str, Any], list[list[int]]]:
    core = llm.llm_engine.core
    check = prompts_for(args.check_prompts, 64, cfg["vocab_size"], seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=args.check_tokens, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in check], greedy)]
    noise = None
    if args.noise_control:
        alone = [llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in check]
        noise = compare(tokens, alone)
    prompts = prompts_for(args.num_prompts, args.input_len, cfg["vocab_size"], seed=0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:32]], params, use_tqdm=False)  # warm-up
    _sync()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _sync()
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
    result = {
        "graph_capture_s": round(core.graph_capture_seconds, 1),
        "generate_s": round(elapsed, 2),
        "tok_s": round(args.num_prompts * args.output_len / elapsed, 1),
        "memory_plan_per_rank": [
            {
                "rank": r,
                "weights_GiB": round((p.weights_bytes or 0) / 2**30, 2),
                "activations_GiB": round((p.activation_bytes or 0) / 2**30, 2),
                "graphs_GiB": round((p.graph_bytes or 0) / 2**30, 2),
                "other_GiB": round((p.non_torch_bytes or 0) / 2**30, 2),
                "kv_GiB": round(p.kv_bytes / 2**30, 2),
                "kv_blocks": p.num_blocks,
                "agreed_blocks": p.usable_blocks,
            }
            for r, p in enumerate(core.memory_plans)
        ],
        "memory_plan_table": ranks_table(core.memory_plans),
    }
    if noise is not None:
        result["check_batched_vs_alone"] = noise
    return result, tokens


def compare(first: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """How far greedy continuations agree: identical ones, where the others first differ, token match rate."""
    flips = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(first, other)]
    return {
        "prompts": len(other),
        "identical": sum(f is None for f in flips),
        "first_divergence_at": [f for f in flips if f is not None],
        "token_match_rate": round(
            sum(a == b for x, y in zip(first, other) for a, b in zip(x, y)) / sum(len(x) for x in other), 4
        ),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shape", choices=("8b", "70b"), default="8b")
    p.add_argument("--quick", action="store_true", help="CPU smoke run on the embedded model (gloo)")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--input-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--check-prompts", type=int, default=32)
    p.add_argument("--check-tokens", type=int, default=64)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="on the GPU")
    p.add_argument(
        "--noise-control",
        action="store_true",
        help="also run each check prompt alone: the flip rate batch composition alone causes on one GPU",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.quick
    args.num_prompts = args.num_prompts or (256 if gpu else 16)
    args.input_len = args.input_len or (512 if gpu else 16)
    args.output_len = args.output_len or (256 if gpu else 16)
    if not gpu:
        args.check_tokens = min(args.check_tokens, 16)
        args.check_prompts = min(args.check_prompts, 8)
    model, cfg = shape_dir(args.shape, not gpu)
    engine_args: dict[str, Any] = dict(
        device="cuda" if gpu else "cpu",
        dtype=args.dtype if gpu else "float32",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len or -(-(args.input_len + args.output_len) // 256) * 256,
        swap_space=0,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    if gpu:
        engine_args["load_format"] = "dummy"
    name = torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-") if gpu else "cpu"
    date = dt.date.today().isoformat()
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "gpus_visible": torch.cuda.device_count() if gpu else 0,
        "date": date,
        "command": "python -m benchmarks.tensor_parallel " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "model_shape": "embedded (CPU smoke run)"
        if not gpu
        else "Llama-3-8B"
        if args.shape == "8b"
        else "Llama-3.1-70B",
        "workload": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len")},
        "engine_args": engine_args,
        "runs": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.dtype == "bfloat16" or not gpu else f"-{args.dtype}"
    suffix += "-noise" if args.noise_control else ""
    path = args.out / f"tp-{name}-{args.shape}{suffix}-{date}.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=2) + "\n")

    if gpu:
        device = torch.device("cuda")
        ceilings = {
            "copy_bytes_per_s": copy_bandwidth(device, 2 << 30),
            "matmul_flops": matmul_rate(device, 8192, torch.bfloat16),
        }
        result["ceilings"] = {
            "copy_TBps": ceilings["copy_bytes_per_s"] / 1e12,
            "matmul_TFLOPs": ceilings["matmul_flops"] / 1e12,
        }
        _free()
        sizes = sorted(
            {args.max_num_seqs * cfg["hidden_size"] * 2, args.max_num_batched_tokens * cfg["hidden_size"] * 2}
        )
        from benchmarks.allreduce import measure

        result["allreduce"] = {str(tp): measure(tp, sizes) for tp in args.tp if tp > 1}
        save()
    baseline_tokens: list[list[int]] | None = None
    for tp in args.tp:
        run, tokens = run_size(model, cfg, tp, args, engine_args)
        if baseline_tokens is None:
            baseline_tokens = tokens
        else:
            run["check_vs_first"] = compare(baseline_tokens, tokens)
        if gpu:
            roof = tp_roofline(cfg, tp, args, ceilings, result["allreduce"].get(str(tp), {}))
            run["roofline"] = {k: round(v, 3) for k, v in roof.items()}
            run["roofline_fraction"] = round(roof["total_s"] / run["generate_s"], 3)
        result["runs"].append(run)
        save()
        print(json.dumps({k: v for k, v in run.items() if k != "memory_plan_table"}), flush=True)
    first = result["runs"][0]
    for run in result["runs"][1:]:
        run["speedup"] = round(run["tok_s"] / first["tok_s"], 3)
        run["scaling_efficiency"] = round(run["speedup"] * first["tp"] / run["tp"], 3)
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
