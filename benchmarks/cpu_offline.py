"""CPU offline throughput: pagekeeper's `LLM.generate` against looping transformers' `generate`.

    python -m benchmarks.cpu_offline [--num-prompts 32] [--max-tokens 64] [--model DIR]
                                     [--out benchmarks/results] [--threads 2] [--quick]
                                     [--repeats 3] [--no-static-batch]

Everything runs in one process, on CPU, float32, with `torch.set_num_threads(threads)`:

1. pagekeeper: one `LLM.generate` call over all prompts (greedy, `ignore_eos=True`, so every request
   yields exactly `max_tokens` tokens), timed after a short warm-up call.  Engine construction is
   excluded from the timing and reported on its own as `pagekeeper_load_s`.
2. transformers, the usual baseline: `model.generate` over the prompts one at a time (batch 1),
   after a warm-up call, with `min_new_tokens == max_new_tokens`.
3. transformers static batching: every prompt in one left-padded `generate` call.

Each timed call is repeated `--repeats` times (default 3) and the fastest is reported: on a shared
2-core machine one other busy process can slow multi-threaded torch several-fold, and the minimum
is the least disturbed sample.  Every sample is kept in the JSON (`*_all_s`), with the 1-minute
load average before and after.

The prompts are built from the Zen of Python (lines, line prefixes and runs of 2-3 lines), so their
lengths vary.  The greedy tokens of (1) are checked against those of (2), prompt by prompt, and the
result is recorded as `outputs_match_hf`.

EOS handling: `ignore_eos` in pagekeeper (as in vLLM) only stops EOS from ending a request, it does
not take EOS out of the sampling.  `min_new_tokens` in transformers, by contrast, masks EOS' logit
until the minimum is reached, which would change greedy picks whenever EOS is the argmax.  So that
both sides compute the same thing, the baseline runs with the generation config's `eos_token_id`
cleared (nothing stops early, nothing is masked) and `min_new_tokens=max_new_tokens` on top; each
output's length is checked to be exactly `max_tokens`.

The JSON result goes to `<out>/cpu-offline-<YYYY-MM-DD>.json`.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import copy
import datetime as _dt
import io
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

QUICK_NUM_PROMPTS = 4
QUICK_MAX_TOKENS = 8


# --------------------------------------------------------------------------------------------- prompts


def zen_lines() -> list[str]:
    """The 19 aphorisms of the Zen of Python (the title and attribution line left out)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen on first import)
    text = codecs.decode(this.s, "rot13")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # lines[0] is "The Zen of Python, by Tim Peters"
    return [ln for ln in lines[1:]]


def build_prompts(n: int) -> list[str]:
    """`n` deterministic prompts of varied length: line prefixes, whole lines, runs of 2-3 lines.

    Prompt i starts at Zen line (i * 7) mod 19 and, cycling through four shapes, is
    a prefix of the first few words of a line, a whole line, two lines, or three lines.
    """
    lines = zen_lines()
    m = len(lines)
    prompts = []
    for i in range(n):
        start = (i * 7) % m
        shape = i % 4
        if shape == 0:  # a short prefix: the first 1-3 words
            words = lines[start].split()
            k = 1 + (i // 4) % 3
            prompts.append(" ".join(words[: min(k, len(words))]))
        elif shape == 1:  # one whole line
            prompts.append(lines[start])
        else:  # 2 or 3 consecutive lines (wrapping round)
            count = 2 if shape == 2 else 3
            prompts.append("\n".join(lines[(start + j) % m] for j in range(count)))
    return prompts


# --------------------------------------------------------------------------------------------- helpers


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def reproduce_command(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in ["python", "-m", "benchmarks.cpu_offline", *argv])


# --------------------------------------------------------------------------------------------- runs


def run_pagekeeper(
    model_dir: str, prompts: list[str], max_tokens: int, threads: int, repeats: int = 1
) -> dict[str, Any]:
    import torch

    from engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, device="cpu", dtype="float32")
    load_s = time.perf_counter() - t0

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # Warm-up: a couple of prompts, a few tokens (first-call allocations, lazy imports, ...).
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
    return {
        "load_s": load_s,
        "seconds": min(times),
        "all_seconds": times,
        "prompt_token_ids": [list(o.prompt_token_ids) for o in outs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "llm": llm,
    }


def load_hf(model_dir: str, threads: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.to("cpu").eval()
    # See the module docstring: no early stop, no EOS masking, same as pagekeeper's ignore_eos.
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = None
    gc.do_sample = False
    if gc.pad_token_id is None:
        gc.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    model.generation_config = gc
    return tok, model


def run_hf_loop(tok, model, prompt_ids: list[list[int]], max_tokens: int, repeats: int = 1) -> dict[str, Any]:
    import torch

    def one(ids: list[int], n: int) -> list[int]:
        x = torch.tensor([ids], dtype=torch.long)
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
        return out[0, len(ids) :].tolist()

    with torch.inference_mode():
        one(prompt_ids[0], min(4, max_tokens))  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            token_ids = [one(ids, max_tokens) for ids in prompt_ids]
            times.append(time.perf_counter() - t0)
    return {"seconds": min(times), "all_seconds": times, "token_ids": token_ids}


def run_hf_static_batch(tok, model, prompt_ids: list[list[int]], max_tokens: int, repeats: int = 1) -> dict[str, Any]:
    import torch

    pad = model.generation_config.pad_token_id
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1

    def call(x, m, n):
        return model.generate(input_ids=x, attention_mask=m, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    with torch.inference_mode():
        call(ids[:2], mask[:2], min(4, max_tokens))  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = call(ids, mask, max_tokens)
            times.append(time.perf_counter() - t0)
    return {"seconds": min(times), "all_seconds": times, "token_ids": out[:, width:].tolist()}


# --------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.cpu_offline",
        description="CPU offline throughput: pagekeeper LLM.generate vs transformers generate.",
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the embedded default model)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON result")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for both sides")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: {QUICK_NUM_PROMPTS} prompts x {QUICK_MAX_TOKENS} tokens",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs per side after the warm-up; the fastest is reported, all are kept in the "
        "JSON (default 3, or 1 with --quick)",
    )
    p.add_argument("--no-static-batch", action="store_true", help="skip the HF static-batch run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    num_prompts = QUICK_NUM_PROMPTS if args.quick else args.num_prompts
    max_tokens = QUICK_MAX_TOKENS if args.quick else args.max_tokens
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if min(num_prompts, max_tokens, args.threads, args.repeats) <= 0:
        raise SystemExit("--num-prompts, --max-tokens, --threads and --repeats must be positive")

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    if args.model is None:
        from engine.default_model import DEFAULT_MODEL_DIR

        model_dir = str(DEFAULT_MODEL_DIR)
    else:
        model_dir = str(Path(args.model).resolve())

    torch.set_num_threads(args.threads)
    prompts = build_prompts(num_prompts)

    tok, hf_model = load_hf(model_dir, args.threads)
    prompt_ids = [list(tok(p)["input_ids"]) for p in prompts]
    max_pos = int(getattr(hf_model.config, "max_position_embeddings", 0) or 0)
    longest = max(len(p) for p in prompt_ids)
    if max_pos and longest + max_tokens > max_pos:
        raise SystemExit(
            f"longest prompt ({longest} tokens) + --max-tokens {max_tokens} exceeds the model's "
            f"max_position_embeddings ({max_pos}); lower --max-tokens"
        )

    print(f"model: {model_dir}", flush=True)
    print(f"{num_prompts} prompts x {max_tokens} tokens, threads={args.threads}", flush=True)

    print("pagekeeper ...", flush=True)
    load_before = _loadavg()
    pk = run_pagekeeper(model_dir, prompts, max_tokens, args.threads, args.repeats)
    del pk["llm"]  # not needed further; the engine's KV cache stays allocated otherwise
    torch.set_num_threads(args.threads)  # in case the engine changed it

    print("transformers loop ...", flush=True)
    hf = run_hf_loop(tok, hf_model, prompt_ids, max_tokens, args.repeats)

    static = None
    if not args.no_static_batch:
        print("transformers static batch ...", flush=True)
        try:
            static = run_hf_static_batch(tok, hf_model, prompt_ids, max_tokens, args.repeats)
        except Exception as e:  # optional: report, do not fail the benchmark
            print(f"static batch failed: {type(e).__name__}: {e}", flush=True)

    total_out = num_prompts * max_tokens
    lengths_ok = all(len(t) == max_tokens for t in pk["token_ids"]) and all(
        len(t) == max_tokens for t in hf["token_ids"]
    )
    prompts_match = pk["prompt_token_ids"] == prompt_ids
    mismatched = [i for i, (a, b) in enumerate(zip(pk["token_ids"], hf["token_ids"])) if a != b]
    outputs_match = lengths_ok and prompts_match and not mismatched and len(pk["token_ids"]) == num_prompts

    plens = [len(p) for p in prompt_ids]
    result: dict[str, Any] = {
        "date": _dt.date.today().isoformat(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu",
        "cpu_model": cpu_model_name(),
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "model": model_dir,
        "dtype": "float32",
        "quick": bool(args.quick),
        "repeats": args.repeats,
        # Other processes on the machine skew CPU timings; the 1-minute load average before the
        # timed runs and after them lets a reader judge (ideally both well under `threads`).
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": _loadavg(),
        "num_prompts": num_prompts,
        "max_tokens": max_tokens,
        "output_tokens": total_out,
        "prompt_tokens": {
            "min": min(plens),
            "max": max(plens),
            "mean": round(statistics.fmean(plens), 2),
            "total": sum(plens),
        },
        "pagekeeper_load_s": round(pk["load_s"], 4),
        "pagekeeper_s": round(pk["seconds"], 4),
        "pagekeeper_tok_s": round(total_out / pk["seconds"], 2),
        "pagekeeper_all_s": [round(t, 4) for t in pk["all_seconds"]],
        "hf_loop_s": round(hf["seconds"], 4),
        "hf_loop_tok_s": round(total_out / hf["seconds"], 2),
        "hf_loop_all_s": [round(t, 4) for t in hf["all_seconds"]],
        "speedup_vs_hf_loop": round(hf["seconds"] / pk["seconds"], 3),
        "outputs_match_hf": bool(outputs_match),
        "output_lengths_exact": bool(lengths_ok),
        "prompt_tokens_match_hf": bool(prompts_match),
        "mismatched_prompts": mismatched,
        "command": reproduce_command(raw_argv),
    }
    if static is not None:
        result["hf_static_batch_s"] = round(static["seconds"], 4)
        result["hf_static_batch_tok_s"] = round(total_out / static["seconds"], 2)
        result["hf_static_batch_all_s"] = [round(t, 4) for t in static["all_seconds"]]
        result["speedup_vs_hf_static_batch"] = round(static["seconds"] / pk["seconds"], 3)
        # Informational: padding can move float32 results by an ulp, so this may differ.
        result["hf_static_batch_outputs_match_hf_loop"] = static["token_ids"] == hf["token_ids"]

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / f"cpu-offline-{result['date']}.json"
    out_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    print_table(result)
    print(f"wrote {out_path}", flush=True)
    result["_path"] = str(out_path)
    return result


def print_table(r: dict[str, Any]) -> None:
    pt = r["prompt_tokens"]
    print()
    print(
        f"CPU offline benchmark: {r['num_prompts']} prompts x {r['max_tokens']} tokens "
        f"(prompt tokens min/mean/max {pt['min']}/{pt['mean']}/{pt['max']}), "
        f"{r['threads']} threads, {r['cpu_model']}"
    )
    rows = [("pagekeeper LLM.generate", r["pagekeeper_s"], r["pagekeeper_tok_s"], 1.0)]
    rows.append(("HF generate loop (bs=1)", r["hf_loop_s"], r["hf_loop_tok_s"], r["hf_loop_s"] / r["pagekeeper_s"]))
    if "hf_static_batch_s" in r:
        rows.append(
            (
                "HF generate static batch",
                r["hf_static_batch_s"],
                r["hf_static_batch_tok_s"],
                r["hf_static_batch_s"] / r["pagekeeper_s"],
            )
        )
    print(f"{'run':<26} {'wall s':>9} {'out tok/s':>10} {'pk speedup':>11}")
    print("-" * 59)
    for name, s, tps, sp in rows:
        print(f"{name:<26} {s:>9.3f} {tps:>10.1f} {sp:>10.2f}x")
    print(f"pagekeeper load: {r['pagekeeper_load_s']:.2f} s; outputs match HF loop: {r['outputs_match_hf']}")
    print(f"1-min load average before/after: {r['loadavg_1m_before']}/{r['loadavg_1m_after']}")


if __name__ == "__main__":
    main()
