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
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from benchmarks.memory import LLAMA3_8B, model_dir
from engine import LLM, SamplingParams

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


def prompts_for(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (num, length), generator=g).tolist()


def run_pagekeeper(
    model: str,
    engine_args: dict[str, Any],
    prompts: list[list[int]],
    output_len: int,
) -> tuple[LLM, float, float]:
    """(llm, cold start seconds, generate seconds) for one configuration."""
    t = time.perf_counter()
    llm = LLM(model, **engine_args)
    cold = time.perf_counter() - t
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # Warm-up: enough prompts for a prefill step and a mixed (decode + prefill) one, so that no
    # kernel is compiled inside the timed run.
    llm.generate([{"prompt_token_ids": p} for p in prompts[:32]], params, use_tqdm=False)
    _sync()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _sync()
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs), "every request must run to max_tokens"
    return llm, cold, elapsed


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


def profile_summary(llm: LLM, prompts: list[list[int]], output_len: int, top: int = 12) -> dict[str, Any]:
    """Profile a decode-heavy slice of the same workload: GPU busy/idle and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    _sync()
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        _sync()
    wall_us = (time.perf_counter() - t) * 1e6
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in kernels])
    per_name: dict[str, float] = {}
    for e in kernels:
        per_name[e.name] = per_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    total_kernel = sum(per_name.values()) or 1.0
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "workload": {"prompts": len(prompts), "input_len": len(prompts[0]), "output_len": output_len},
        "wall_ms": round(wall_us / 1e3, 1),
        "gpu_busy_ms": round(busy_us / 1e3, 1),
        "gpu_idle_fraction": round(1 - busy_us / wall_us, 4) if kernels else None,
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
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--input-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--hf-batches", type=int, nargs="*", help="static batch sizes for transformers generate")
    p.add_argument("--skip-hf", action="store_true", help="pagekeeper only")
    p.add_argument("--skip-generate-batch", action="store_true")
    p.add_argument("--skip-eager", action="store_true", help="skip the --enforce-eager cold start and run")
    p.add_argument("--profile-output-len", type=int, default=64, help="output tokens of the profiled slice (0: none)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--cold-start-only", choices=("graphs", "eager"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    passthrough = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--skip-hf",)]

    gpu = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if gpu else "cpu")
    num = args.num_prompts or (256 if gpu else 32)
    in_len = args.input_len or (512 if gpu else 16)
    out_len = args.output_len or (256 if gpu else 32)
    hf_batches = args.hf_batches if args.hf_batches is not None else ([64, 256] if gpu else [8, 32])
    dtype = torch.bfloat16 if gpu else torch.float32
    model = model_dir(quick=not gpu)
    cfg = LLAMA3_8B if gpu else json.loads((Path(model) / "config.json").read_text())
    engine_args: dict[str, Any] = dict(
        device=device.type,
        dtype="bfloat16" if gpu else "float32",
        max_num_seqs=args.max_num_seqs,
        max_model_len=-(-(in_len + out_len) // 256) * 256,
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
    name = torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-") if gpu else "cpu"
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "date": dt.date.today().isoformat(),
        "command": "python -m benchmarks.throughput " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "model_shape": cfg.get("architectures", ["?"])[0] + (" (Llama-3-8B shape)" if gpu else " (embedded)"),
        "dtype": str(dtype).removeprefix("torch."),
        "workload": {
            "num_prompts": num,
            "input_len": in_len,
            "output_len": out_len,
            "greedy": True,
            "ignore_eos": True,
        },
        "engine_args": engine_args,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"throughput-{name}-{result['date']}.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=2) + "\n")

    phases = tqdm(total=6, desc="throughput benchmark", position=0)
    # 1. ceilings
    result["copy_TBps"] = copy_bandwidth(device, (2 << 30) if gpu else (256 << 20)) / 1e12
    result["matmul_TFLOPs"] = matmul_rate(device, 8192 if gpu else 1024, dtype) / 1e12
    phases.update()
    prompts = prompts_for(num, in_len, cfg["vocab_size"], seed=0)
    total_tokens = num * out_len
    # 2. pagekeeper with CUDA graphs (the default)
    llm, cold, elapsed = run_pagekeeper(model, engine_args, prompts, out_len)
    result["cold_start_s"] = round(cold, 2)
    result["graph_capture_s"] = round(llm.llm_engine.core.graph_capture_seconds, 2)
    result["pagekeeper_s"] = round(elapsed, 3)
    result["pagekeeper_tok_s"] = round(total_tokens / elapsed, 1)
    plan = llm.llm_engine.core.kv_plan
    result["memory_plan"] = {
        "kv_bytes": plan.kv_bytes,
        "num_blocks": plan.num_blocks,
        "graph_bytes": plan.graph_bytes,
        "activation_bytes": plan.activation_bytes,
    }
    save()
    phases.update()
    # 3. where the time goes
    if args.profile_output_len:
        result["profile"] = profile_summary(llm, prompts, args.profile_output_len)
        save()
    llm = None  # frees the memory now (a closure above still names it)
    _free()
    phases.update()
    # 4. eager (no CUDA graphs), for the cold-start comparison
    if not args.skip_eager:
        llm, cold, elapsed = run_pagekeeper(model, {**engine_args, "enforce_eager": True}, prompts, out_len)
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
            secs = hf_static(hf, prompts, out_len, b, device)
            result[f"hf_static_bs{b}_tok_s"] = round(total_tokens / secs, 1)
            save()
        if not args.skip_generate_batch:
            try:
                secs, generated = hf_generate_batch(hf, prompts, out_len)
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
    # 6. the roofline
    roof = roofline_seconds(
        cfg,
        num,
        in_len,
        out_len,
        args.max_num_seqs,
        torch.empty((), dtype=dtype).element_size(),
        result["matmul_TFLOPs"] * 1e12,
        result["copy_TBps"] * 1e12,
    )
    result["roofline"] = {k: (round(v, 4) if k.endswith("_s") else v) for k, v in roof.items()}
    result["roofline_tok_s"] = round(total_tokens / roof["total_s"], 1)
    result["roofline_fraction"] = round(result["pagekeeper_tok_s"] / result["roofline_tok_s"], 4)
    statics = [v for k, v in result.items() if k.startswith("hf_static_bs") and v]
    if statics:
        result["speedup_vs_best_hf_static"] = round(result["pagekeeper_tok_s"] / max(statics), 2)
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
