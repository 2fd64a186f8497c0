"""Issue 39's device run on one GPU (H100 or H200), in one command, within a deadline.

    bash benchmarks/quant_device_run.sh                      # OUT=<folder>: what benchmarks/quant_device_run.sh runs
    python -m benchmarks.quant_device_run --out DIR [--stages kernels engines tests legacy gemv] [--deadline-s 520]
    python -m benchmarks.quant_device_run --out DIR --stages perplexity serving   # must-shows 2 and 4, one call
    python -m benchmarks.quant_device_run --quick --out DIR  # the same stages on the CPU (interpreter, embedded model)

Stages, each a fresh process (its GPU memory gone when it ends), most important first, each stopped (its process
group killed) when it would pass the deadline, its output streamed to the console and to DIR/run.log:

    kernels   benchmarks/quant_kernels.py: every FP8 / AWQ path beside bf16 at the 8B's GEMM sizes, M = 1, 8, 32,
              256, 4096, each with its weight-read floor and error, the fastest path per M (`rule`), then tile
              sweeps of the new kernels for --sweep-budget-s  -> DIR/quant-kernels-<gpu>-<date>.json
    engines   benchmarks/quantization.py on the 8B shape: bf16 / fp8 weights / fp8 weights + fp8 KV / AWQ,
              throughput at 256 x (512 in, 256 out), ms/token at batch 1, 8, 32 with each one's weight-read floor,
              issue 39's top-level keys  -> DIR/quantization-<gpu>-<date>.json (benchmarks/results/'s file)
    tests     pytest -m gpu over the quantized-matmul tests (the new kernels at the 8B's shapes, against the
              reference)  -> DIR/gpu-quant-tests-<gpu>-<date>.log
    legacy    the fp8 and AWQ engines again with PAGEKEEPER_QUANT_KERNELS=legacy (the previous kernels), when
              time is left: the same run's A/B  -> DIR/quantization-<gpu>-<date>-legacy.json
    gemv      the fp8 and AWQ engines at batch 1 and 8 with PAGEKEEPER_QUANT_KERNELS=gemv (the bandwidth-shaped
              decode kernels in front): the A/B that decides whether they become the default
              -> DIR/quantization-<gpu>-<date>-gemv.json
    perplexity  benchmarks/perplexity.py: a small Llama trained for PERPLEXITY_TRAIN_S on the stdlib's sources,
              its held-out perplexity and greedy agreement in bf16 / fp8 weights / fp8 KV / AWQ; its ppl_ratio_*
              keys also go into DIR's quantization-*.json when the engines stage wrote one
              -> DIR/perplexity-<gpu>-<date>.json
    serving   benchmarks/quant_serving.py: `opsctl start` with bf16, fp8 and awq on the 8B shape, one completion
              each, `opsctl doctor`'s weight bytes  -> DIR/quant-serving-<gpu>-<date>.json

The default stages are the first four (about 8 minutes on an H100); perplexity and serving fit a call of their own.

Each stage's JSON is rewritten as it goes, so a stage stopped or failed keeps what it measured.  After every
stage DIR/quant-device-run-<gpu>-<date>.json is rewritten: the stages (exit code, seconds, stopped or not), the
issue's keys from the engines stage, and the kernel stage's rule.  Exit 1 if any stage failed or was skipped.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.tp_device_run import Log, _commit, pytest_summary, run_stage

REPO = Path(__file__).resolve().parents[1]
STAGES = ("kernels", "engines", "tests", "legacy", "gemv", "perplexity", "serving")
ARMS = {"legacy": ["1"], "gemv": ["1", "8"]}  # the kernel-set A/B stages: the batches each one times
DEFAULT_STAGES = ("kernels", "engines", "tests", "legacy")
# The longest each stage may take on one H100 (the deadline cuts it shorter when less is left): the kernel table
# is ~200 timed products and ~30 compiles, then the sweep; the engines stage is four 8B engines of ~65 s each;
# perplexity is data and tokenizer (~20 s), training, then four small engines; serving is three 8B starts, each
# with a completion, doctor and a stop.
STAGE_LIMIT_S = {
    "kernels": 170, "engines": 320, "tests": 120, "legacy": 200, "gemv": 200, "perplexity": 310, "serving": 200,
}  # fmt: skip
PERPLEXITY_TRAIN_S = 120  # of the stage's 310 s (benchmarks/perplexity.py's own default is 150)
STOP_MARGIN_S = 15  # the serving stage stops its deployments this long before its limit (they outlive a kill)
QUICK_LIMIT_FACTOR = 4  # the CPU dry run: Triton's interpreter on a shared machine, only the deadline matters
MIN_STAGE_S = 30  # a stage with less than this left is skipped (it could not finish anything useful)
ENGINE_CONFIGS = ["bf16", "fp8_weights", "fp8_weights_fp8_kv", "awq"]
QUICK_ENGINE_CONFIGS = ["bf16", "fp8_weights", "awq"]
TEST_FILES = [
    "tests/kernels/test_fp8_linear.py",
    "tests/kernels/test_w4a16.py",
    "tests/kernels/test_quant_dispatch.py",
    "tests/kernels/test_awq_gemm.py",
]


def engines_file(out: Path) -> Path | None:
    """The engines stage's results file in `out` (the newest, not an A/B arm's), if there is one."""
    files = sorted(p for p in out.glob("quantization-*.json") if not p.stem.endswith(tuple(f"-{a}" for a in ARMS)))
    return files[-1] if files else None


def commands(
    stage: str, out: Path, quick: bool, sweep_s: float, limit_s: float | None = None
) -> tuple[list[str], dict[str, str]]:
    """The stage's command line and the environment it adds (`limit_s`: the time the stage gets)."""
    py = [sys.executable, "-m"]
    env: dict[str, str] = {"TRITON_INTERPRET": "1"} if quick else {}
    if stage == "perplexity":
        cmd = py + [
            "benchmarks.perplexity",
            "--out",
            str(out),
            "--train-seconds",
            "2" if quick else str(PERPLEXITY_TRAIN_S),
        ]
        merge = engines_file(out)
        return cmd + (["--merge", str(merge)] if merge else []) + (["--quick"] if quick else []), {}
    if stage == "serving":
        deadline = (limit_s if limit_s is not None else STAGE_LIMIT_S[stage]) - STOP_MARGIN_S
        return py + ["benchmarks.quant_serving", "--out", str(out), "--deadline-s", str(round(deadline))] + (
            ["--quick"] if quick else []
        ), {}
    if stage == "kernels":
        return py + ["benchmarks.quant_kernels", "--out", str(out), "--sweep-budget-s", str(sweep_s)] + (
            ["--quick"] if quick else []
        ), env
    if stage == "tests":
        return py + ["pytest", "-q", "-s", "-p", "no:cacheprovider", "-m", "gpu", *TEST_FILES], {}
    configs = (QUICK_ENGINE_CONFIGS if quick else ENGINE_CONFIGS) if stage == "engines" else ["fp8_weights", "awq"]
    batches = ["1", "2"] if quick else ["1", "8", "32"]
    cmd = py + ["benchmarks.quantization", "--skip-kernels", "--out", str(out), "--configs", *configs]
    arm_batches = ["1"] if quick else ARMS.get(stage, ["1"])
    cmd += ["--batches", *(batches if stage == "engines" else arm_batches)] + (["--quick"] if quick else [])
    if stage in ARMS:
        return cmd + ["--tag", stage], {"PAGEKEEPER_QUANT_KERNELS": stage}
    return cmd, {}


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def summarize(summary: dict[str, Any], out: Path, slug: str, date: str) -> None:
    """The issue's keys and the per-engine rows from the engines stage, the kernel stage's rule, the legacy and gemv
    A/Bs, the perplexity stage's ratios (over the engines file's nulls) and the serving stage's weight ratios."""
    engines = _read(out / f"quantization-{slug}-{date}.json")
    if engines is not None:
        from benchmarks.quantization import ISSUE39_KEYS

        for key in (*ISSUE39_KEYS, "fp8_fp8_kv_throughput_ratio", "throughput_vs_bf16"):
            if key in engines:
                summary[key] = engines[key]
        summary["engines"] = {
            name: {k: row.get(k) for k in ("throughput_tok_s", "batch1", "decode", "error", "seconds") if k in row}
            for name, row in engines.get("engines", {}).items()
        }
    kernels = _read(out / f"quant-kernels-{slug}-{date}.json")
    if kernels is not None:
        summary["kernel_rule"] = {
            m: {k: v for k, v in entry.items() if k != "layer_ms"} for m, entry in kernels.get("rule", {}).items()
        }
        summary["kernel_errors"] = {
            f"{r['layer']} M={r['M']}": r["errors"] for r in kernels.get("rows", []) if "errors" in r
        }
    for arm in ARMS:
        arm_data = _read(out / f"quantization-{slug}-{date}-{arm}.json")
        if arm_data is not None:
            summary[arm] = {
                name: {k: row.get(k) for k in ("throughput_tok_s", "batch1", "decode", "error") if k in row}
                for name, row in arm_data.get("engines", {}).items()
            }
    ppl = _read(out / f"perplexity-{slug}-{date}.json")
    if ppl is not None:
        for key in ("ppl_ratio_fp8", "ppl_ratio_fp8_kv", "ppl_ratio_awq"):
            if ppl.get(key) is not None:
                summary[key] = ppl[key]
        summary["perplexity"] = {
            k: ppl.get(k)
            for k in (
                "ppl_transformers", "ppl_bf16", "ppl_fp8", "ppl_fp8_kv", "ppl_awq", "ppl_engine_over_transformers",
                "greedy_agreement", "model", "training", "seconds",
            )
        }  # fmt: skip
        errors = {c: row["error"] for c, row in ppl.get("engines", {}).items() if "error" in row}
        if errors:
            summary["perplexity"]["errors"] = errors
    serving = _read(out / f"quant-serving-{slug}-{date}.json")
    if serving is not None:
        summary["serving"] = {k: v for k, v in serving.items() if "weight_ratio" in k}
        summary["serving"]["configs"] = {
            name: {k: row.get(k) for k in ("completion", "doctor_weights_line", "error", "skipped") if k in row}
            for name, row in serving.get("configs", {}).items()
        }


def device_run(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.kernels import device_slug

    started = time.monotonic()
    deadline = started + args.deadline_s
    gpu = torch.cuda.is_available() and not args.quick
    if not gpu and not args.quick:
        print("error: no CUDA device; use --quick for the CPU dry run", file=sys.stderr)
        return 2
    slug = device_slug(gpu)
    date = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    final = args.out / f"quant-device-run-{slug}-{date}.json"
    tests_log = args.out / f"gpu-quant-tests-{slug}-{date}.log"
    log = Log(args.out / "run.log")
    summary: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "date": date,
        "command": "python -m benchmarks.quant_device_run " + " ".join(args.argv),
        "commit": _commit(),
        "torch": torch.__version__,
        "deadline_s": args.deadline_s,
        "stages": [],
    }

    def save() -> None:
        summarize(summary, args.out, slug, date)
        final.write_text(json.dumps(summary, indent=2) + "\n")

    save()
    log.line(f"issue 39 device run: {summary['gpu']}, stages {' '.join(args.stages)}, deadline {args.deadline_s} s")
    for stage in args.stages:
        left = deadline - time.monotonic()
        if left < MIN_STAGE_S:
            summary["stages"].append({"name": stage, "skipped": f"{left:.0f} s left before the deadline"})
            log.line(f"=== stage {stage}: skipped, {left:.0f} s left before the deadline")
            save()
            continue
        limit = min(left, STAGE_LIMIT_S[stage] * (QUICK_LIMIT_FACTOR if args.quick else 1))
        cmd, env = commands(stage, args.out, args.quick, args.sweep_budget_s, limit)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # run_stage passes this process's environment on
        try:
            if stage == "tests":
                with tests_log.open("w", encoding="utf-8") as f:
                    f.write(f"# python {' '.join(cmd[1:])} on {summary['gpu']}, {date}\n")
                    f.flush()
                    row = run_stage(stage, cmd, limit, log, f)
                row["counts"] = pytest_summary(tests_log.read_text(errors="replace"))
                row["log"] = tests_log.name
            else:
                row = run_stage(stage, cmd, limit, log)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if env:
            row["env"] = env
        summary["stages"].append(row)
        save()
    summary["wall_s"] = round(time.monotonic() - started, 1)
    save()
    failed = [s["name"] for s in summary["stages"] if s.get("rc") not in (0, None) or s.get("skipped")]
    from benchmarks.quantization import ISSUE39_KEYS

    for key in ISSUE39_KEYS:
        log.line(f"  {key}: {summary.get(key)}")
    if "serving" in summary:
        log.line(f"  serving: {json.dumps({k: v for k, v in summary['serving'].items() if k != 'configs'})}")
    log.line(f"wrote {final} ({summary['wall_s']} s); stages not done or failed: {failed or 'none'}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="where the results and logs go ($OUT on the device)")
    p.add_argument("--quick", action="store_true", help="the CPU dry run (Triton's interpreter, embedded model)")
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(DEFAULT_STAGES))
    p.add_argument("--deadline-s", type=float, default=520.0, help="seconds before every stage is done or stopped")
    p.add_argument("--sweep-budget-s", type=float, default=40.0, help="the kernel stage's tile sweeps")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.deadline_s <= 0 or args.sweep_budget_s < 0:
        p.error("--deadline-s must be > 0 and --sweep-budget-s >= 0")
    return device_run(args)


if __name__ == "__main__":
    sys.exit(main())
