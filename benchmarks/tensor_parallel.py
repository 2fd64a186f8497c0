"""Tensor parallelism on GPUs (issues 19, 36): throughput at TP = 1, 2, 4 against lower bounds, and correctness.

    python -m benchmarks.tensor_parallel --tp 1 2 4                      # Llama-3-8B shape: the scaling curve
    python -m benchmarks.tensor_parallel --shape 70b --tp 4 --overlap-ab 2048 --batch1
    python -m benchmarks.tensor_parallel --correctness --tp 1 2 4        # float32 tokens, bf16 logits vs TP=1
    python -m benchmarks.tensor_parallel --quick --tp 1 2 --overlap-ab 2 --batch1   # CPU smoke run (gloo)

Throughput: for each size, the throughput benchmark's workload (256 prompts x 512 tokens in, 256 out, greedy,
no EOS) on random weights (load_format=dummy, drawn per checkpoint tensor from a generator seeded by its name,
so every size serves the same model), the engine's memory plan of every rank, and the run's lower bounds
(benchmarks/tp_bounds.py): per rank and per step the scheduler really planned, the GEMMs and the attention at
the device's measured peaks, the all-reduces at this host's measured time for their exact sizes, summed
serially and overlapped.  A fraction of a bound above 1.0 means the bound is wrong.  `--overlap-ab TOKENS`
times the workload twice on one engine (TP > 1): the plain steps, then with --tensor-parallel-overlap-tokens
TOKENS switched on every rank (engine/model/overlap.py); the engine starts with the overlap enabled at a
threshold no step reaches, so NCCL's high-priority stream is in place for both and the start-up profile
measures the plain steps.  `--batch1` adds one request alone: milliseconds per output token.

Correctness: greedy tokens of 32 prompts at each size against the first, in float32 (where they must be
equal: rate reported) and in bf16 (where random weights make near-ties everywhere, so greedy equality is
noise); both with teacher-forced logits of 16 prompts compared with the first size's (max |difference|, and
how often the argmax agrees), and in bf16 the same comparison between two batchings of the first size alone
(the noise that batch composition by itself causes).  On a Llama-3.2-1B shape, which fits one GPU in float32.

Writes benchmarks/results/tp-<gpu>x<gpus>-<shape>[-correctness]-<date>.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from benchmarks.kernels import device_slug
from benchmarks.memory import LLAMA3_8B
from benchmarks.step_roofline import recorded_steps
from benchmarks.throughput import _free, _sync, prompts_for
from benchmarks.tp_bounds import AllReduceTable, Peaks, RankModel, measure_peaks, run_bounds
from engine import LLM, SamplingParams
from engine.default_model import DEFAULT_MODEL_DIR
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
LLAMA32_1B = {
    **LLAMA3_8B,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
SHAPES = {"1b": ("Llama-3.2-1B", LLAMA32_1B), "8b": ("Llama-3-8B", LLAMA3_8B), "70b": ("Llama-3.1-70B", LLAMA31_70B)}
OVERLAP_IDLE = 1 << 30  # a threshold no step reaches: the overlap enabled (NCCL's stream priority) but idle
BATCH1_TOKENS = 64


def shape_dir(shape: str, quick: bool) -> tuple[str, dict[str, Any]]:
    """A checkpoint directory of `shape` (config and the embedded tokenizer; the weights are drawn at load), or the
    embedded model itself for the CPU smoke run."""
    import shutil
    import tempfile

    if quick:
        return str(DEFAULT_MODEL_DIR), json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    d = Path(tempfile.mkdtemp(prefix=f"llama-{shape}-shape-"))
    own = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    cfg = {**SHAPES[shape][1], "bos_token_id": own["bos_token_id"], "eos_token_id": own["eos_token_id"]}
    (d / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, d / name)
    return str(d), cfg


def dtype_of(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


# -- lower bounds: the device's peaks and this host's all-reduces --------------------------------------------------


def allreduce_sizes(hiddens: list[int], dtype_bytes: int, max_num_seqs: int, max_tokens: int) -> list[int]:
    """Message sizes to measure: every power-of-two token count up to `max_tokens`, the batch cap and half the
    step cap (a micro-batch), times each hidden size."""
    tokens = {1 << k for k in range(max_tokens.bit_length()) if 1 << k <= max_tokens}
    tokens |= {max_num_seqs, max_tokens, max(1, max_tokens // 2)}
    return sorted({t * h * dtype_bytes for t in tokens for h in hiddens})


def device_peaks(args: argparse.Namespace, cfg: dict[str, Any], gpu: bool, dtype: torch.dtype) -> dict[str, Any]:
    """benchmarks/tp_bounds.measure_peaks over this shape's per-rank GEMMs at every size run."""
    size = torch.empty((), dtype=dtype).element_size()
    gemms = sorted({g for tp in args.tp for g in RankModel.of(cfg, tp, size).gemms()})
    big = sorted({args.max_num_batched_tokens, max(1, args.max_num_batched_tokens // 2)})
    if gpu:
        return measure_peaks(torch.device("cuda"), dtype, gemms, big, [1, args.max_num_seqs])
    return measure_peaks(  # the CPU smoke run: the same code, small enough to take seconds
        torch.device("cpu"), dtype, gemms, [min(big[0], 64)], [1], stream_bytes=8 << 20, square=256, cold_bytes=1 << 20
    )


def allreduce_tables(args: argparse.Namespace, cfg: dict[str, Any], gpu: bool, size: int) -> dict[str, Any]:
    """{str(tp): benchmarks/allreduce.py's table} for every size > 1: read from --allreduce-json or measured now."""
    tps = sorted({tp for tp in args.tp if tp > 1})
    if not tps:
        return {}
    if args.allreduce_json and not Path(args.allreduce_json).exists():
        print(f"--allreduce-json {args.allreduce_json} does not exist (no allreduce stage ran): measuring", flush=True)
    elif args.allreduce_json:
        found = json.loads(Path(args.allreduce_json).read_text())
        missing = [tp for tp in tps if str(tp) not in found]
        if not missing:
            return {str(tp): found[str(tp)] for tp in tps}
        print(f"--allreduce-json has no table for TP {missing}: measuring", flush=True)
    from benchmarks.allreduce import measure

    if gpu:
        sizes = allreduce_sizes([cfg["hidden_size"]], size, args.max_num_seqs, args.max_num_batched_tokens)
    else:
        sizes = [cfg["hidden_size"] * 4 * t for t in (1, 16)]  # the smoke run: two sizes
    result: dict[str, Any] = measure(tps, sizes, "cuda" if gpu else "cpu")
    return result


# -- throughput ----------------------------------------------------------------------------------------------------


def run_size(
    model: str,
    cfg: dict[str, Any],
    tp: int,
    args: argparse.Namespace,
    engine_args: dict[str, Any],
    peaks: Peaks,
    tables: dict[str, Any],
    result: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Start an engine of `tp` ranks and measure it, filling `result` as it goes (`save` after each part, so that
    a part that fails or hangs leaves what came before it in the file)."""
    extra = {"tensor_parallel_overlap_tokens": OVERLAP_IDLE} if args.overlap_ab and tp > 1 else {}
    t = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, **engine_args, **extra)
    result["cold_start_s"] = round(time.perf_counter() - t, 1)
    try:
        _measure(llm, cfg, tp, args, engine_args, peaks, tables, result, save)
    finally:
        llm.close()
        del llm  # the engine's memory goes back to the device before the next size starts
        _free()


def _rank0_model(llm: LLM) -> Any:
    runner = llm.llm_engine.core.runner
    return runner.local.model if hasattr(runner, "local") else runner.model


def _measure(
    llm: LLM,
    cfg: dict[str, Any],
    tp: int,
    args: argparse.Namespace,
    engine_args: dict[str, Any],
    peaks: Peaks,
    tables: dict[str, Any],
    result: dict[str, Any],
    save: Callable[[], None],
) -> None:
    core = llm.llm_engine.core
    result["graph_capture_s"] = round(core.graph_capture_seconds, 1)
    result["memory_plan_per_rank"] = memory_plan(core.memory_plans)
    result["memory_plan_table"] = ranks_table(core.memory_plans)
    save()
    if args.check_prompts:
        check = prompts_for(args.check_prompts, 64, cfg["vocab_size"], seed=1)
        greedy = SamplingParams(temperature=0, max_tokens=args.check_tokens, ignore_eos=True)
        args.check_outputs[tp] = [o.outputs[0].token_ids for o in llm.generate(_inputs(check), greedy)]
    prompts = prompts_for(args.num_prompts, args.input_len, cfg["vocab_size"], seed=0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(_inputs(prompts[:32]), params, use_tqdm=False)  # warm-up
    arms: list[tuple[str, int]] = [("plain", 0)]
    if args.overlap_ab and tp > 1:
        arms.append(("overlap", args.overlap_ab))
    size = torch.empty((), dtype=dtype_of(engine_args["dtype"])).element_size()
    rank_model = RankModel.of(cfg, tp, size)
    table = AllReduceTable.from_result(tables[str(tp)]) if tp > 1 else None
    model = _rank0_model(llm)
    result["arms"] = []
    for name, tokens in arms:
        if args.overlap_ab and tp > 1:
            llm.llm_engine.core.runner.set_overlap_tokens(tokens or OVERLAP_IDLE)
            if tokens:  # the overlapped path's first steps (new GEMM shapes) outside the timing
                warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
                llm.generate(_inputs(prompts[:32]), warm, use_tqdm=False)
        before = getattr(model, "overlapped_steps", 0)
        with recorded_steps(llm) as steps:
            _sync()
            t = time.perf_counter()
            outs = llm.generate(_inputs(prompts), params)
            _sync()
            elapsed = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        bounds = run_bounds(steps, rank_model, peaks, table)
        by_kind = steps.seconds_by_kind(t + elapsed)
        for kind, row in by_kind.items():
            decode = kind == "decode"
            part = run_bounds([s for s in steps if all(n == 1 for _, n in s.seqs) == decode], rank_model, peaks, table)
            row["seconds"] = round(row["seconds"], 3)
            row.update({k: part[k] for k in ("compute_s", "allreduce_s", "serial_s", "overlapped_s")})
        arm = {
            "arm": name,
            "overlap_tokens": tokens,
            "generate_s": round(elapsed, 3),
            "tok_s": round(args.num_prompts * args.output_len / elapsed, 1),
            "overlapped_forwards": getattr(model, "overlapped_steps", 0) - before,
            "bounds": bounds,
            # measured wall time (approximate by about a step: pipelined steps) and bounds of each kind of step
            "by_step_kind": by_kind,
            "bound_fraction_serial": round(bounds["serial_s"] / elapsed, 3),
            "bound_fraction_overlapped": round(bounds["overlapped_s"] / elapsed, 3),
        }
        # the plain steps cannot beat the serial bound, nor any step the overlapped one, unless a bound is wrong
        if arm["bound_fraction_overlapped"] > 1.0 or (
            not arm["overlapped_forwards"] and arm["bound_fraction_serial"] > 1
        ):
            arm["bound_warning"] = "faster than a lower bound: a measured peak or all-reduce time is wrong"
        result["arms"].append(arm)
        result.setdefault("tok_s", arm["tok_s"])
        save()
        print(json.dumps({"tp": tp, **{k: v for k, v in arm.items() if k != "bounds"}}), flush=True)
    if args.overlap_ab and tp > 1:
        llm.llm_engine.core.runner.set_overlap_tokens(OVERLAP_IDLE)
    if args.profile and not (torch.cuda.is_available() and not args.quick):
        result["profile_rank0"] = "skipped: the kernel profile needs CUDA"
    elif args.profile:
        from benchmarks.tp_profile import profile_phases

        runner = llm.llm_engine.core.runner
        overlap = (runner.set_overlap_tokens, args.overlap_ab) if args.overlap_ab and tp > 1 else (None, 0)
        result["profile_rank0"] = profile_phases(llm, cfg["vocab_size"], SamplingParams, prompts_for, *overlap)
        if args.overlap_ab and tp > 1:
            runner.set_overlap_tokens(OVERLAP_IDLE)
        save()
        print(json.dumps({"tp": tp, "profile_rank0": result["profile_rank0"]}), flush=True)
    if args.batch1:
        result["batch1"] = batch1(llm, cfg, args.input_len)
        save()
        print(json.dumps({"tp": tp, "batch1": result["batch1"]}), flush=True)


def _inputs(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


def batch1(llm: LLM, cfg: dict[str, Any], prompt_len: int) -> dict[str, Any]:
    """One request alone: ms per output token, from the time of 1 + BATCH1_TOKENS tokens minus that of 1 (the
    prefill), the faster of two tries each."""
    one = _inputs(prompts_for(1, prompt_len, cfg["vocab_size"], seed=2))
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    more = SamplingParams(temperature=0, max_tokens=1 + BATCH1_TOKENS, ignore_eos=True)
    llm.generate(one, more, use_tqdm=False)  # warm-up
    times: dict[str, float] = {"first": float("inf"), "more": float("inf")}
    for _ in range(2):
        for key, params in (("first", first), ("more", more)):
            _sync()
            t = time.perf_counter()
            llm.generate(one, params, use_tqdm=False)
            _sync()
            times[key] = min(times[key], time.perf_counter() - t)
    return {
        "prompt_tokens": prompt_len,
        "output_tokens": 1 + BATCH1_TOKENS,
        "prefill_s": round(times["first"], 4),
        "ms_per_token": round((times["more"] - times["first"]) / BATCH1_TOKENS * 1e3, 3),
    }


def memory_plan(plans: list[Any]) -> list[dict[str, Any]]:
    return [
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
        for r, p in enumerate(plans)
    ]


def compare(first: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """How far greedy continuations agree: identical ones, where the others first differ, token match rate."""
    flips = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(first, other)]
    return {
        "prompts": len(other),
        "identical": sum(f is None for f in flips),
        "first_divergence_at": [f for f in flips if f is not None],
        "token_match_rate": round(
            sum(a == b for x, y in zip(first, other) for a, b in zip(x, y)) / max(1, sum(len(x) for x in other)), 4
        ),
    }


def scaling(runs: list[dict[str, Any]]) -> None:
    """Speed-up and scaling efficiency of each run against the first (in place)."""
    measured = [r for r in runs if r.get("tok_s")]
    for run in measured[1:]:
        first = measured[0]
        run["speedup"] = round(run["tok_s"] / first["tok_s"], 3)
        run["scaling_efficiency"] = round(run["speedup"] * first["tp"] / run["tp"], 3)


# -- correctness ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def teacher_forced_logits(llm: LLM, rows: int) -> Iterator[list[torch.Tensor]]:
    """The float32 logits rank 0 computes for prompt logprobs, one [rows, vocab] tensor per prompt of rows + 1
    tokens, in the order the prompts were given (the sampled rows' logits are left out: another row count)."""
    model = _rank0_model(llm)
    original = model.compute_logits
    got: list[torch.Tensor] = []

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        if logits.shape[0] == rows:
            got.append(logits.detach().float().cpu())
        return logits

    model.compute_logits = capture
    try:
        yield got
    finally:
        del model.compute_logits  # the class's method again


def score(llm: LLM, prompts: list[list[int]], group: int) -> list[torch.Tensor]:
    """Teacher-forced logits of every prompt, `group` prompts per generate call."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    with teacher_forced_logits(llm, len(prompts[0]) - 1) as got:
        for i in range(0, len(prompts), group):
            llm.generate(_inputs(prompts[i : i + group]), params, use_tqdm=False)
    if len(got) != len(prompts):
        raise RuntimeError(f"captured {len(got)} prompts' logits for {len(prompts)} prompts")
    return got


def logit_diff(first: list[torch.Tensor], other: list[torch.Tensor]) -> dict[str, Any]:
    a, b = torch.cat(first), torch.cat(other)
    diff = (a - b).abs()
    return {
        "positions": a.shape[0],
        "max_abs_logit_diff": round(float(diff.max()), 6),
        "mean_abs_logit_diff": round(float(diff.mean()), 7),
        "max_abs_logit": round(float(a.abs().max()), 4),
        "argmax_agreement": round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 4),
    }


def correctness(args: argparse.Namespace, gpu: bool, result: dict[str, Any], save: Any) -> None:
    model, cfg = shape_dir(args.shape, not gpu)
    prompts = prompts_for(args.check_prompts, args.prompt_len, cfg["vocab_size"], seed=1)
    scored = prompts[: args.scored_prompts]
    greedy = SamplingParams(temperature=0, max_tokens=args.check_tokens, ignore_eos=True)
    for dtype in args.dtypes:
        first_tokens: list[list[int]] | None = None
        first_logits: list[torch.Tensor] | None = None
        rows: dict[str, Any] = {}
        result["correctness"][dtype] = rows
        for tp in args.tp:
            engine_args = dict(
                device="cuda" if gpu else "cpu",
                dtype=dtype,
                max_num_seqs=max(args.check_prompts, 16),
                max_model_len=-(-(args.prompt_len + args.check_tokens) // 256) * 256,
                swap_space=0,
                gpu_memory_utilization=0.5,
            )
            if gpu:
                engine_args["load_format"] = "dummy"
            t = time.perf_counter()
            llm = LLM(model, tensor_parallel_size=tp, **engine_args)
            try:
                tokens = [o.outputs[0].token_ids for o in llm.generate(_inputs(prompts), greedy, use_tqdm=False)]
                logits = score(llm, scored, len(scored))
                noise = None
                if first_logits is None and dtype != "float32" and len(scored) > 1:
                    noise = logit_diff(logits, score(llm, scored, max(1, len(scored) // 4)))
            finally:
                llm.close()
                del llm
                _free()
            row: dict[str, Any] = {"tp": tp, "seconds": round(time.perf_counter() - t, 1)}
            if first_tokens is None or first_logits is None:
                first_tokens, first_logits = tokens, logits
                if noise is not None:
                    row["batch_composition_noise"] = noise  # the same size, the prompts batched 4 at a time
            else:
                row["greedy_vs_first"] = compare(first_tokens, tokens)
                row["logits_vs_first"] = logit_diff(first_logits, logits)
            rows[f"tp{tp}"] = row
            save()
            print(json.dumps({"dtype": dtype, **row}), flush=True)


# -- main ----------------------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shape", choices=sorted(SHAPES), help="default: 8b, or 1b with --correctness")
    p.add_argument("--quick", action="store_true", help="CPU smoke run on the embedded model (gloo)")
    p.add_argument("--correctness", action="store_true", help="tokens and logits against the first size instead")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--input-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--check-prompts", type=int, help="greedy check prompts (default 32; 0 skips them)")
    p.add_argument("--check-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64, help="--correctness: tokens per check prompt")
    p.add_argument("--scored-prompts", type=int, default=16, help="--correctness: prompts whose logits compare")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="throughput on the GPU")
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    p.add_argument("--overlap-ab", type=int, default=0, metavar="TOKENS", help="time the overlap off and on (TP > 1)")
    p.add_argument("--batch1", action="store_true", help="also one request alone: ms per output token")
    p.add_argument("--profile", action="store_true", help="GPU: rank 0's kernels by kind (benchmarks/tp_profile.py)")
    p.add_argument("--allreduce-json", type=Path, help="benchmarks/allreduce.py's output, instead of measuring")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--json", type=Path, help="write the result to this file (default: a dated name under --out)")
    args = p.parse_args(argv)
    if any(tp < 1 for tp in args.tp) or len(set(args.tp)) != len(args.tp):
        p.error("--tp takes distinct sizes >= 1")
    if args.overlap_ab < 0 or args.overlap_ab == 1:
        p.error("--overlap-ab takes a threshold of 2 tokens or more")
    if args.correctness and (args.overlap_ab or args.batch1 or args.profile):
        p.error("--overlap-ab, --batch1 and --profile are throughput options, not --correctness ones")
    args.shape = args.shape or ("1b" if args.correctness else "8b")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    gpu = torch.cuda.is_available() and not args.quick
    if gpu and torch.cuda.device_count() < max(args.tp):
        print(f"benchmarks.tensor_parallel --tp {max(args.tp)} needs as many GPUs", file=sys.stderr)
        return 2
    if args.check_prompts is None:
        args.check_prompts = 32 if gpu else 8
    if not gpu:
        args.check_tokens = min(args.check_tokens, 16)
        args.prompt_len = min(args.prompt_len, 24)
        args.scored_prompts = min(args.scored_prompts, 4)
    args.num_prompts = args.num_prompts or (256 if gpu else 16)
    args.input_len = args.input_len or (512 if gpu else 16)
    args.output_len = args.output_len or (256 if gpu else 16)
    name = device_slug(gpu)
    gpus = torch.cuda.device_count() if gpu else 0
    date = dt.date.today().isoformat()
    kind = "correctness" if args.correctness else args.shape
    path = args.json or args.out / f"tp-{name}x{gpus}-{kind}-{date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "gpus_visible": gpus,
        "date": date,
        "command": "python -m benchmarks.tensor_parallel " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "model_shape": SHAPES[args.shape][0] if gpu else "embedded (CPU smoke run)",
    }

    def save() -> None:
        path.write_text(json.dumps(result, indent=2) + "\n")

    if args.correctness:
        result.update(prompts=args.check_prompts, prompt_len=args.prompt_len, check_tokens=args.check_tokens)
        result.update(scored_prompts=args.scored_prompts, correctness={})
        correctness(args, gpu, result, save)
        save()
        print(f"wrote {path}")
        return 0
    model, cfg = shape_dir(args.shape, not gpu)
    dtype = args.dtype if gpu else "float32"
    engine_args: dict[str, Any] = dict(
        device="cuda" if gpu else "cpu",
        dtype=dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len or -(-(args.input_len + args.output_len) // 256) * 256,
        swap_space=0,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    if gpu:
        engine_args["load_format"] = "dummy"
    result.update(
        workload={k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len")}, engine_args=engine_args
    )
    found = device_peaks(args, cfg, gpu, dtype_of(dtype))
    peaks = Peaks(found["matmul_flops"], found["bytes_per_s"])
    result["peaks"] = {
        "matmul_TFLOPs": round(peaks.matmul_flops / 1e12, 1),
        "read_TBps": round(peaks.bytes_per_s / 1e12, 3),
        **{k: v for k, v in found.items() if k not in ("matmul_flops", "bytes_per_s")},
    }
    _free()
    size = torch.empty((), dtype=dtype_of(dtype)).element_size()
    tables = allreduce_tables(args, cfg, gpu, size)
    result["allreduce"] = tables
    result["runs"] = []
    save()
    args.check_outputs = {}
    failed = False
    for tp in args.tp:
        run: dict[str, Any] = {"tp": tp}
        result["runs"].append(run)
        try:
            run_size(model, cfg, tp, args, engine_args, peaks, tables, run, save)
        except Exception as e:  # the next size still runs; the file says what failed
            failed = True
            run["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            traceback.print_exc()
        first, tokens = args.check_outputs.get(args.tp[0]), args.check_outputs.get(tp)
        if tp != args.tp[0] and first is not None and tokens is not None:
            run["check_vs_first"] = compare(first, tokens)
        scaling(result["runs"])
        save()
        print(json.dumps({k: v for k, v in run.items() if k not in ("memory_plan_table", "arms")}), flush=True)
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
