"""Offline throughput (issue 6): pagekeeper vs transformers on the same device, against the roofline.

    python -m benchmarks.throughput                # GPU: random-weight Llama-3-8B shape, bf16,
                                                   # 256 prompts x 512 input tokens, 256 output tokens
    python -m benchmarks.throughput --quick        # CPU smoke run on the embedded model (CI)

One process, one device, one run: the device's ceilings (a large device-to-device copy, counting
bytes read + written, and a large bf16 matrix product) are measured first, then pagekeeper (cold
start with and without CUDA graphs, then generate), then transformers' `generate` at static batch
sizes and `generate_batch` (its continuous batching), all greedy with no EOS.  The roofline time is

    prefill FLOPs / matmul rate + sum over decode steps of (weight bytes + KV bytes read) / copy bandwidth

and pagekeeper's fraction of it is reported, with a torch-profiler summary of a decode-heavy slice
(GPU idle fraction, top kernels) that says where the rest goes.  Writes
benchmarks/results/throughput-<gpu>-<date>.json.  Weights are random (load_format="dummy"), so the
cold start includes generating them instead of reading a checkpoint from disk.

    python -m benchmarks.throughput --workload long-tailed   # 1,000 requests, lognormal lengths

The long-tailed workload is chat traffic's shape: prompt and output lengths lognormal with medians near
200, capped at 2,048 / 1,024, seedable (`--seed`).  Its bound is schedule-aware
(benchmarks/step_roofline.py): the scheduler's own steps, each at max(bytes / copy bandwidth, FLOPs /
matmul rate), with the additive bound beside it.  transformers runs static batches of a prefix of the
requests (`--hf-requests`, left-padded, each batch generating its longest output), and pagekeeper runs
the same prefix too, so the two compare on equal work.  `--structured-fraction F` reruns the workload
with a JSON schema on that fraction of the requests (structured outputs' throughput cost).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from benchmarks.memory import LLAMA3_8B, long_tailed, model_dir
from benchmarks.step_roofline import ModelCost, StepShape, bounds, recorded_steps
from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams

RESULTS = Path(__file__).resolve().parent / "results"


# -- device ceilings ---------------------------------------------------------------------------


def _median_time(fn: Callable[[], None], device: torch.device, repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of fn(); CUDA events on a GPU, the host clock on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by one large copy (the memory-bound ceiling)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), device)
    src = dst = None  # frees the memory now (a closure above still names it)
    return 2 * nbytes / t


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype) -> float:
    """FLOP/s of one n x n x n product on random data (the compute-bound ceiling)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = _median_time(lambda: a @ b, device)
    a = b = None  # frees the memory now (a closure above still names it)
    return 2 * n**3 / t


# -- the roofline ------------------------------------------------------------------------------


def roofline_seconds(
    cfg: dict[str, Any],
    num_prompts: int,
    input_len: int,
    output_len: int,
    max_num_seqs: int,
    dtype_bytes: int,
    matmul_flops: float,
    copy_bytes_per_s: float,
) -> dict[str, float]:
    """The fastest any engine could run this workload on this device (see the module docstring)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or h // heads
    linear = layers * (h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + 3 * h * inter)
    lm_head = h * vocab
    prompt_tokens = num_prompts * input_len
    # matmuls over every prompt token, causal attention (QK^T and PV), the LM head on the last token
    attn = layers * 2 * 2 * heads * head_dim * num_prompts * input_len * (input_len + 1) / 2
    prefill_flops = 2 * linear * prompt_tokens + attn + 2 * lm_head * num_prompts
    weight_bytes = (linear + lm_head) * dtype_bytes
    kv_per_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    decode_bytes = 0.0
    left = num_prompts
    while left > 0:  # waves of at most max_num_seqs sequences decoding together
        batch = min(left, max_num_seqs)
        for step in range(1, output_len):  # the first output token comes out of the prefill
            decode_bytes += weight_bytes + batch * (input_len + step) * kv_per_token
        left -= batch
    prefill_s = prefill_flops / matmul_flops
    decode_s = decode_bytes / copy_bytes_per_s
    return {
        "prefill_flops": prefill_flops,
        "decode_bytes": decode_bytes,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": prefill_s + decode_s,
    }


# -- pagekeeper --------------------------------------------------------------------------------


Workload = list[tuple[list[int], int]]  # (prompt token ids, output tokens), in arrival order

# A schema a random-weight model can keep writing inside until max_tokens (a list of free strings), so
# that structured requests do about the work of plain ones; the grammar mask is the cost measured.
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["notes"],
}


def prompts_for(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (num, length), generator=g).tolist()


def long_tailed_workload(
    num: int, vocab: int, seed: int, prompt_median: float, output_median: float, prompt_cap: int, output_cap: int
) -> Workload:
    """Chat traffic's shape: lognormal prompt and output lengths, most short, a long tail to the caps."""
    rng = random.Random(seed)
    prompt_lens = long_tailed(rng, num, prompt_median, 1.0, 4, prompt_cap)
    output_lens = long_tailed(rng, num, output_median, 0.9, 2, output_cap)
    return [([rng.randrange(10, vocab) for _ in range(p)], o) for p, o in zip(prompt_lens, output_lens)]


def structured_rows(num: int, fraction: float) -> frozenset[int]:
    """Which requests carry a schema: evenly spread, `fraction` of them."""
    return frozenset(i for i in range(num) if int((i + 1) * fraction) > int(i * fraction))


def params_for(work: Workload, structured: frozenset[int] = frozenset()) -> list[SamplingParams]:
    schema = StructuredOutputsParams(json=STRUCTURED_SCHEMA)
    return [
        SamplingParams(
            temperature=0, max_tokens=o, ignore_eos=True, structured_outputs=schema if i in structured else None
        )
        for i, (_, o) in enumerate(work)
    ]


def timed_generate(
    llm: LLM, work: Workload, structured: frozenset[int] = frozenset(), use_tqdm: bool = True
) -> tuple[float, int, list[StepShape], list[Any]]:
    """(seconds, generated tokens, the steps the scheduler planned, outputs) of one generate call."""
    params = params_for(work, structured)
    _sync()
    with recorded_steps(llm) as steps:
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=use_tqdm)
        _sync()
        elapsed = time.perf_counter() - t
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return elapsed, generated, list(steps), outs


def run_pagekeeper(
    model: str,
    engine_args: dict[str, Any],
    work: Workload,
) -> tuple[LLM, float, float, list[StepShape]]:
    """(llm, cold start seconds, generate seconds, the steps it ran) for one configuration."""
    t = time.perf_counter()
    llm = LLM(model, **engine_args)
    cold = time.perf_counter() - t
    # Warm-up: enough prompts for a prefill step and a mixed (decode + prefill) one, so that no
    # kernel is compiled inside the timed run.
    timed_generate(llm, work[:32], use_tqdm=False)
    elapsed, generated, steps, _ = timed_generate(llm, work)
    assert generated == sum(o for _, o in work), "every request must run to max_tokens"
    return llm, cold, elapsed, steps


def structured_run(llm: LLM, work: Workload, fraction: float, plain_tok_s: float) -> dict[str, Any]:
    """The same workload with a JSON schema on `fraction` of the requests: throughput beside the plain run."""
    rows = structured_rows(len(work), fraction)
    elapsed, generated, _, outs = timed_generate(llm, work, rows)
    complete = valid = 0
    for i in rows:
        out = outs[i].outputs[0]
        if out.finish_reason == "stop":
            complete += 1
            try:
                valid += isinstance(json.loads(out.text), dict)
            except ValueError:
                pass
    tok_s = generated / elapsed
    return {
        "fraction": fraction,
        "structured_requests": len(rows),
        "schema": STRUCTURED_SCHEMA,
        "generated_tokens": generated,
        "planned_tokens": sum(o for _, o in work),
        "seconds": round(elapsed, 3),
        "tok_s": round(tok_s, 1),
        "ratio_vs_plain": round(tok_s / plain_tok_s, 4),
        "structured_completed": complete,
        "structured_completed_valid_json": valid,
        "note": "structured requests end when their JSON is complete, so tok/s counts the tokens really generated",
    }


def cold_start_in_fresh_process(eager: bool, passthrough: list[str]) -> float:
    """Seconds from `LLM(...)` to ready in a new process (imports excluded, Triton's disk cache warm):
    what a restart costs, free of this process's already-compiled kernels."""
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "benchmarks.throughput",
        "--cold-start-only",
        "eager" if eager else "graphs",
        *passthrough,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"cold-start child failed ({r.returncode}): {r.stderr[-2000:]}")
    return float(r.stdout.strip().splitlines()[-1])


KERNEL_CATEGORIES = (  # first match wins; names as the H100/H200 profiles show them
    ("prefill_attention", re.compile(r"_prefill_kernel|flash|cudnn|fmha|attention", re.I)),
    ("decode_attention", re.compile(r"_decode_kernel|_decode_reduce", re.I)),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|cublas|splitK|sm90_xmma|_scaled_mm|awq", re.I)),
    ("sampling", re.compile(r"sort|topk|top_k|softmax|exponential|argmax|max_|reduce_kernel|_sampl|cumsum", re.I)),
    ("norm_act_rotary", re.compile(r"rms_norm|silu|rotary|fused_add", re.I)),
    ("kv_write_copy", re.compile(r"write_kv|copy|memcpy|memset|cat|index", re.I)),
)


def kernel_category(name: str) -> str:
    for category, pattern in KERNEL_CATEGORIES:
        if pattern.search(name):
            return category
    return "other"


def profile_summary(llm: LLM, work: Workload, top: int = 12) -> dict[str, Any]:
    """Profile a slice of the workload: GPU busy/idle, time per kernel category, the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    params = params_for(work)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    _sync()
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
        _sync()
    wall_us = (time.perf_counter() - t) * 1e6
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in kernels])
    per_name: dict[str, float] = {}
    for e in kernels:
        per_name[e.name] = per_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    total_kernel = sum(per_name.values()) or 1.0
    per_category: dict[str, float] = {}
    for n, us in per_name.items():
        c = kernel_category(n)
        per_category[c] = per_category.get(c, 0.0) + us
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "workload": {
            "prompts": len(work),
            "prompt_tokens": sum(len(p) for p, _ in work),
            "output_tokens": sum(o for _, o in work),
        },
        "wall_ms": round(wall_us / 1e3, 1),
        "gpu_busy_ms": round(busy_us / 1e3, 1),
        "gpu_idle_fraction": round(1 - busy_us / wall_us, 4) if kernels else None,
        "kernel_share_by_category": {
            c: round(us / total_kernel, 4) for c, us in sorted(per_category.items(), key=lambda kv: -kv[1])
        },
        "top_kernels": [
            {"name": n[:120], "ms": round(us / 1e3, 2), "share": round(us / total_kernel, 4)} for n, us in ranked
        ],
    }


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


# -- transformers ------------------------------------------------------------------------------


def build_hf(model: str, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model)
    with torch.device(device):
        try:
            hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            hf = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    return hf.eval()


def _no_eos_config(hf: Any, output_len: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
    )


def hf_static(hf: Any, prompts: list[list[int]], output_len: int, batch: int, device: torch.device) -> float:
    """Seconds for transformers `generate` over every prompt, `batch` at a time (equal lengths: no padding)."""
    gen = _no_eos_config(hf, output_len)
    with torch.inference_mode():
        hf.generate(torch.tensor(prompts[:2], device=device), generation_config=gen)  # warm-up
        _sync()
        t = time.perf_counter()
        for i in tqdm(range(0, len(prompts), batch), desc=f"transformers generate bs{batch}"):
            ids = torch.tensor(prompts[i : i + batch], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            assert out.shape[1] == ids.shape[1] + output_len
        _sync()
    return time.perf_counter() - t


def hf_static_varlen(hf: Any, work: Workload, batch: int, device: torch.device) -> tuple[float, int]:
    """(seconds, useful tokens) for transformers `generate` in arrival-order static batches, left-padded;
    each batch generates its longest output for every row (what static batching costs), and only the
    tokens each request asked for count."""
    useful = 0
    with torch.inference_mode():
        hf.generate(torch.tensor([work[0][0][:8]], device=device), generation_config=_no_eos_config(hf, 2))
        _sync()
        t = time.perf_counter()
        for i in tqdm(range(0, len(work), batch), desc=f"transformers generate bs{batch} (padded)"):
            rows = work[i : i + batch]
            width = max(len(p) for p, _ in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, (p, _) in enumerate(rows):
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            longest = max(o for _, o in rows)
            gen = _no_eos_config(hf, longest)
            out = hf.generate(ids.to(device), attention_mask=mask.to(device), generation_config=gen)
            assert out.shape[1] == width + longest
            useful += sum(o for _, o in rows)
        _sync()
    return time.perf_counter() - t, useful


def hf_generate_batch(hf: Any, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """(seconds, generated tokens) for transformers' continuous batching with its defaults."""
    gen = _no_eos_config(hf, output_len)
    t = time.perf_counter()
    outs = hf.generate_batch(inputs=prompts, generation_config=gen, progress_bar=True)  # its own no_grad
    _sync()
    elapsed = time.perf_counter() - t
    generated = sum(len(o.generated_tokens) for o in outs.values())
    if generated < len(prompts) * output_len:
        raise RuntimeError(f"generate_batch produced {generated} of {len(prompts) * output_len} tokens")
    return elapsed, generated


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    """Return freed engines' memory to the device (callers drop their references first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU smoke run on the embedded model")
    p.add_argument("--workload", choices=("uniform", "long-tailed"), default="uniform")
    p.add_argument("--num-prompts", type=int, help="default: 256 uniform, 1,000 long-tailed (CPU: 32)")
    p.add_argument("--input-len", type=int, help="uniform: prompt tokens; long-tailed: the median")
    p.add_argument("--output-len", type=int, help="uniform: output tokens; long-tailed: the median")
    p.add_argument("--seed", type=int, default=0, help="the workload's random seed")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--hf-batches", type=int, nargs="*", help="static batch sizes for transformers generate")
    p.add_argument("--hf-requests", type=int, help="long-tailed: transformers runs this prefix of the requests")
    p.add_argument("--skip-hf", action="store_true", help="pagekeeper only")
    p.add_argument("--skip-generate-batch", action="store_true")
    p.add_argument("--skip-eager", action="store_true", help="skip the --enforce-eager cold start and run")
    p.add_argument("--profile-output-len", type=int, default=64, help="output tokens of the profiled slice (0: none)")
    p.add_argument(
        "--structured-fraction", type=float, default=0.0, help="rerun with a JSON schema on this fraction (0: no)"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--cold-start-only", choices=("graphs", "eager"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0.0 <= args.structured_fraction <= 1.0:
        p.error("--structured-fraction must be between 0 and 1")
    passthrough = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--skip-hf",)]

    gpu = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if gpu else "cpu")
    tailed = args.workload == "long-tailed"
    if tailed:
        num = args.num_prompts or (1000 if gpu else 32)
        in_len = args.input_len or (200 if gpu else 12)
        out_len = args.output_len or (200 if gpu else 12)
        prompt_cap, output_cap = (2048, 1024) if gpu else (48, 32)
        longest = prompt_cap + output_cap
    else:
        num = args.num_prompts or (256 if gpu else 32)
        in_len = args.input_len or (512 if gpu else 16)
        out_len = args.output_len or (256 if gpu else 32)
        longest = in_len + out_len
    hf_batches = args.hf_batches if args.hf_batches is not None else ([64, 256] if gpu else [8, 32])
    if tailed and args.hf_batches is None:
        hf_batches = [64] if gpu else [8]
    dtype = torch.bfloat16 if gpu else torch.float32
    model = model_dir(quick=not gpu)
    cfg = LLAMA3_8B if gpu else json.loads((Path(model) / "config.json").read_text())
    engine_args: dict[str, Any] = dict(
        device=device.type,
        dtype="bfloat16" if gpu else "float32",
        max_num_seqs=args.max_num_seqs,
        max_model_len=-(-longest // 256) * 256,
        max_num_on_the_fly_batches=2,
        swap_space=0,
    )
    if gpu:
        engine_args["load_format"] = "dummy"
    if args.cold_start_only:
        t = time.perf_counter()
        LLM(model, **engine_args, enforce_eager=args.cold_start_only == "eager")
        _sync()
        print(time.perf_counter() - t)
        return 0
    if tailed:
        work = long_tailed_workload(num, cfg["vocab_size"], args.seed, in_len, out_len, prompt_cap, output_cap)
    else:
        work = [(p, out_len) for p in prompts_for(num, in_len, cfg["vocab_size"], seed=args.seed)]
    name = torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-") if gpu else "cpu"
    workload: dict[str, Any] = {"kind": args.workload, "num_prompts": num, "greedy": True, "ignore_eos": True}
    if tailed:
        plens, olens = sorted(len(p) for p, _ in work), sorted(o for _, o in work)
        workload.update(
            seed=args.seed,
            lengths="lognormal (sigma 1.0 prompts, 0.9 outputs), capped",
            prompt_median_target=in_len,
            output_median_target=out_len,
            prompt_cap=prompt_cap,
            output_cap=output_cap,
            prompt_len={"median": plens[num // 2], "p90": plens[num * 9 // 10], "max": plens[-1]},
            output_len={"median": olens[num // 2], "p90": olens[num * 9 // 10], "max": olens[-1]},
            prompt_tokens=sum(plens),
            output_tokens=sum(olens),
        )
    else:
        workload.update(input_len=in_len, output_len=out_len)
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "date": dt.date.today().isoformat(),
        "command": "python -m benchmarks.throughput " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "model_shape": cfg.get("architectures", ["?"])[0] + (" (Llama-3-8B shape)" if gpu else " (embedded)"),
        "dtype": str(dtype).removeprefix("torch."),
        "workload": workload,
        "engine_args": engine_args,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-long-tailed" if tailed else ""
    path = args.out / f"throughput-{name}{suffix}-{result['date']}.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=2) + "\n")

    phases = tqdm(total=6, desc="throughput benchmark", position=0)
    # 1. ceilings
    result["copy_TBps"] = copy_bandwidth(device, (2 << 30) if gpu else (256 << 20)) / 1e12
    result["matmul_TFLOPs"] = matmul_rate(device, 8192 if gpu else 1024, dtype) / 1e12
    phases.update()
    total_tokens = sum(o for _, o in work)
    # 2. pagekeeper with CUDA graphs (the default)
    llm, cold, elapsed, steps = run_pagekeeper(model, engine_args, work)
    result["cold_start_s"] = round(cold, 2)
    result["graph_capture_s"] = round(llm.llm_engine.core.graph_capture_seconds, 2)
    result["pagekeeper_s"] = round(elapsed, 3)
    result["pagekeeper_tok_s"] = round(total_tokens / elapsed, 1)
    result["engine_limits"] = {
        "max_num_seqs": llm.llm_engine.config.max_num_seqs,
        "max_num_batched_tokens": llm.llm_engine.config.max_num_batched_tokens,
    }
    plan = llm.llm_engine.core.kv_plan
    result["memory_plan"] = {
        "kv_bytes": plan.kv_bytes,
        "num_blocks": plan.num_blocks,
        "graph_bytes": plan.graph_bytes,
        "activation_bytes": plan.activation_bytes,
    }
    save()
    # the bounds (here, before the slow phases: a cut run still has them)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    matmul, copy = result["matmul_TFLOPs"] * 1e12, result["copy_TBps"] * 1e12
    if not tailed:  # the simple roofline, as this benchmark has always reported it
        roof = roofline_seconds(cfg, num, in_len, out_len, args.max_num_seqs, dtype_bytes, matmul, copy)
        result["roofline"] = {k: (round(v, 4) if k.endswith("_s") else v) for k, v in roof.items()}
        result["roofline_tok_s"] = round(total_tokens / roof["total_s"], 1)
        result["roofline_fraction"] = round(result["pagekeeper_tok_s"] / result["roofline_tok_s"], 4)
    b = bounds(steps, ModelCost.from_config(cfg, dtype_bytes), matmul, copy)
    result["step_bounds"] = {k: (round(v, 4) if k.endswith("_s") else v) for k, v in b.items()}
    result["schedule_aware_fraction"] = round(b["schedule_aware_s"] / elapsed, 4)
    result["additive_fraction"] = round(b["additive_s"] / elapsed, 4)
    result["layer_sequential_fraction"] = round(b["layer_sequential_s"] / elapsed, 4)
    save()
    if args.structured_fraction:
        result["structured"] = structured_run(llm, work, args.structured_fraction, total_tokens / elapsed)
        save()
    phases.update()
    # 3. where the time goes
    if args.profile_output_len:
        if tailed:  # a mixed slice with its own lengths
            sliced = work[: min(len(work), 200 if gpu else 8)]
        else:
            sliced = [(p, args.profile_output_len) for p, _ in work]
        result["profile"] = profile_summary(llm, sliced)
        save()
    hf_work = work[: args.hf_requests or (64 if gpu else 16)] if tailed else work
    if tailed and not args.skip_hf:  # pagekeeper on transformers' share of the requests, for a like-for-like ratio
        secs, generated, _, _ = timed_generate(llm, hf_work, use_tqdm=False)
        result["pagekeeper_on_hf_requests_tok_s"] = round(generated / secs, 1)
    llm = None  # frees the memory now (a closure above still names it)
    _free()
    phases.update()
    # 4. eager (no CUDA graphs), for the cold-start comparison
    if not args.skip_eager:
        llm, cold, elapsed, _ = run_pagekeeper(model, {**engine_args, "enforce_eager": True}, work)
        result["cold_start_eager_s"] = round(cold, 2)
        result["pagekeeper_eager_tok_s"] = round(total_tokens / elapsed, 1)
        llm = None  # frees the memory now (a closure above still names it)
        _free()
        save()
    phases.update()
    # cold starts, each in a fresh process (this one has every kernel compiled already)
    result["cold_start_in_process_s"] = result.pop("cold_start_s")
    result["cold_start_eager_in_process_s"] = result.pop("cold_start_eager_s", None)
    result["cold_start_s"] = round(cold_start_in_fresh_process(False, passthrough), 2)
    if not args.skip_eager:
        result["cold_start_eager_s"] = round(cold_start_in_fresh_process(True, passthrough), 2)
    result["cold_start_note"] = (
        "LLM() to ready in a fresh process, random weights generated on the device "
        "(no checkpoint read from disk), Triton's disk cache warm"
    )
    save()
    # 5. transformers on the same device
    if not args.skip_hf:
        hf = build_hf(model, dtype, device)
        for b in hf_batches:
            if tailed:
                secs, useful = hf_static_varlen(hf, hf_work, b, device)
                result[f"hf_static_bs{b}_tok_s"] = round(useful / secs, 1)
            else:
                secs = hf_static(hf, [p for p, _ in work], out_len, b, device)
                result[f"hf_static_bs{b}_tok_s"] = round(total_tokens / secs, 1)
            save()
        if tailed:
            result["hf_requests"] = len(hf_work)
        elif not gpu:  # measured: 12.5 GB peak RSS for 16 prompts of 12 tokens (transformers 5.17), over a
            # test's 2 GB on the machines CI runs on
            result["hf_generate_batch_tok_s"] = None
            result["hf_generate_batch_error"] = "not run on CPU: transformers' generate_batch peaked at 12.5 GB"
        elif not args.skip_generate_batch:
            try:
                secs, generated = hf_generate_batch(hf, [p for p, _ in work], out_len)
                result["hf_generate_batch_tok_s"] = round(generated / secs, 1)
            except Exception as e:  # an older/newer transformers without it: say so in the JSON
                result["hf_generate_batch_tok_s"] = None
                result["hf_generate_batch_error"] = f"{type(e).__name__}: {e}"[:500]
            save()
        import transformers

        result["transformers"] = transformers.__version__
        hf = None  # frees the memory now (a closure above still names it)
        _free()
    phases.update()
    ref = "hf_static_bs"
    statics = [v for k, v in result.items() if k.startswith(ref) and v]
    if statics:
        mine = result.get("pagekeeper_on_hf_requests_tok_s", result["pagekeeper_tok_s"])
        result["speedup_vs_best_hf_static"] = round(mine / max(statics), 2)
    phases.update()
    phases.close()
    save()
    _print_table(result)
    print(f"wrote {path}")
    return 0


def _print_table(r: dict[str, Any]) -> None:
    rows = [
        (k, r.get(k))
        for k in (
            "gpu",
            "copy_TBps",
            "matmul_TFLOPs",
            "pagekeeper_tok_s",
            "pagekeeper_eager_tok_s",
            "hf_static_bs64_tok_s",
            "hf_static_bs256_tok_s",
            "hf_static_bs8_tok_s",
            "hf_static_bs32_tok_s",
            "hf_generate_batch_tok_s",
            "roofline_tok_s",
            "roofline_fraction",
            "schedule_aware_fraction",
            "additive_fraction",
            "layer_sequential_fraction",
            "pagekeeper_on_hf_requests_tok_s",
            "speedup_vs_best_hf_static",
            "cold_start_s",
            "cold_start_eager_s",
        )
        if k in r
    ]
    if "profile" in r:
        rows.append(("profile gpu_idle_fraction", r["profile"]["gpu_idle_fraction"]))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {round(v, 3) if isinstance(v, float) else v}")


if __name__ == "__main__":
    sys.exit(main())
