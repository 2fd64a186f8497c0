"""Issue 36's whole device run on one multi-GPU machine, in one command, within a deadline.

    bash benchmarks/tp_device_run.sh                         # OUT=<folder>: what benchmarks/tp_device_run.sh runs
    python -m benchmarks.tp_device_run --out DIR [--stages allreduce 70b 8b correctness tests] [--deadline-s 540]
    python -m benchmarks.tp_device_run --quick --out DIR     # the same stages on the CPU (gloo, embedded model)
    python -m benchmarks.tp_device_run --merge FILE --set tp4_restart_failed=0 tp4_restart_longest_gap_s=1.9

Stages, each a fresh process (its GPU memory and NCCL groups gone when it ends), most important first, each
stopped (its process group killed) when it would pass the deadline, its output streamed to the console and to
DIR/run.log:

    allreduce     benchmarks/allreduce.py at every message size the 8B and 70B shapes use, TP 2 and 4
    70b           Llama-3.1-70B shape at TP 4: memory plan per rank, the throughput workload with the overlap
                  off and on (--overlap-ab), batch-1 ms per token, both bounds (benchmarks/tp_bounds.py)
    70b-nccl      the same with every all-reduce on NCCL (PAGEKEEPER_TP_ALLREDUCE=nccl): the engine before the
                  symmetric-memory sum of small all-reduces (engine/parallel/peer_allreduce.py), in the same run
    8b            Llama-3-8B shape at TP 1, 2, 4: the scaling curve and its bounds
    8b-nccl       the same with every all-reduce on NCCL
    correctness   float32 greedy tokens and bf16 logits at TP 2 and 4 against TP 1 (Llama-3.2-1B shape)
    tests         pytest tests/kernels/test_tensor_parallel_gpu.py (TP 2 and 4: graphs, eager, overlap)

After every stage DIR/tp-<gpu>x<n>-<date>.json is rewritten: the stages' results and the issue's top-level keys
(`scaling_efficiency_tp4`, `tp4_70b_tok_s`, `tp4_70b_bound_fraction` against the overlapped bound, the arm they
come from in `tp4_70b_arm`, `tp4_restart_failed`).  `tp4_restart_failed` is left null: the opsctl restart run
(issue 36's third part) fills it with `--merge FILE --set tp4_restart_failed=N` (values are JSON).  The pytest
log is DIR/gpu-tp-tests-<gpu>x<n>-<date>.log.  Three files in all.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
STAGES = ("allreduce", "70b", "70b-nccl", "8b", "8b-nccl", "correctness", "tests")
# Stages that run another stage's command under other environment variables (an A/B across engine starts)
STAGE_ENV = {
    "70b-nccl": ("70b", {"PAGEKEEPER_TP_ALLREDUCE": "nccl"}),
    "8b-nccl": ("8b", {"PAGEKEEPER_TP_ALLREDUCE": "nccl"}),
}
OVERLAP_TOKENS = 2048  # a half of 1,024+ rows: compute-bound GEMMs on an H100/H200 (engine/model/overlap.py)
ENV = {  # NVLink multicast stays off (the device's own rule), output unbuffered
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONUNBUFFERED": "1",
}
# The largest time each stage may take on a 4-GPU H100/H200 host (the deadline cuts it shorter when less is left)
STAGE_LIMIT_S = {
    "allreduce": 150,
    "70b": 300,
    "70b-nccl": 300,
    "8b": 200,
    "8b-nccl": 200,
    "correctness": 200,
    "tests": 300,
}
SHAPE_HIDDEN = (4096, 8192)  # the 8B and 70B shapes' all-reduce rows


class Log:
    """Lines to the console and to DIR/run.log, flushed as they come."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")
        self.lock = threading.Lock()

    def line(self, text: str) -> None:
        with self.lock:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            self.file.write(text + "\n")
            self.file.flush()


def run_stage(
    name: str,
    cmd: list[str],
    limit_s: float,
    log: Log,
    extra_log: IO[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run `cmd` in a process group of its own; kill the group past `limit_s`.  Returns rc, seconds, timed_out."""
    shown = " ".join(f"{k}={v}" for k, v in (extra_env or {}).items())
    log.line(f"=== stage {name}: {shown + ' ' if shown else ''}{' '.join(cmd)} (at most {limit_s:.0f} s)")
    env = {**os.environ, **ENV, **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
    )

    def pump() -> None:
        assert proc.stdout is not None
        for text in proc.stdout:
            log.line(f"[{name}] {text.rstrip()}")
            if extra_log is not None:
                extra_log.write(text)
                extra_log.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=max(1.0, limit_s))
    except subprocess.TimeoutExpired:
        timed_out = True
        log.line(f"=== stage {name}: past its {limit_s:.0f} s, stopping it (process group {proc.pid})")
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        rc = proc.wait()
    reader.join(timeout=10)
    seconds = round(time.monotonic() - started, 1)
    log.line(f"=== stage {name}: exit {rc} after {seconds} s")
    return {"name": name, "rc": rc, "seconds": seconds, "timed_out": timed_out}


def _gpu() -> tuple[str, int]:
    import torch

    from benchmarks.kernels import gpu_slug

    if not torch.cuda.is_available():
        return "cpu", 0
    return gpu_slug(torch.cuda.get_device_name()), torch.cuda.device_count()


def allreduce_grid(max_num_seqs: int = 256, max_tokens: int = 8192) -> list[int]:
    """Every size the 8B and 70B shapes' forwards all-reduce in the throughput workload and batch-1 (bf16)."""
    from benchmarks.tensor_parallel import allreduce_sizes

    return allreduce_sizes(list(SHAPE_HIDDEN), 2, max_num_seqs, max_tokens)


def commands(stage: str, quick: bool, gpus: int, work: Path, sizes: list[int], overlap: int) -> list[str] | None:
    """The stage's command line, or None when this machine has too few GPUs for it (the smoke run: two CPU ranks
    stand for the largest size)."""
    if stage in STAGE_ENV:
        base = commands(STAGE_ENV[stage][0], quick, gpus, work, sizes, overlap)
        own = str(work / f"{STAGE_ENV[stage][0]}.json")
        return None if base is None else [str(work / f"{stage}.json") if a == own else a for a in base]
    py = [sys.executable, "-m"]
    ar = ["--allreduce-json", str(work / "allreduce.json")]
    if stage == "tests":
        return py + ["pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/kernels/test_tensor_parallel_gpu.py"]
    if quick:
        table = {
            "allreduce": py + ["benchmarks.allreduce", "--device", "cpu", "--tp", "2", "--sizes", "512", "8192"],
            "70b": py + ["benchmarks.tensor_parallel", "--quick", "--tp", "2", "--overlap-ab", "2", "--batch1"],
            "8b": py + ["benchmarks.tensor_parallel", "--quick", "--tp", "1", "2"],
            "correctness": py + ["benchmarks.tensor_parallel", "--quick", "--correctness", "--tp", "1", "2"],
        }
    else:
        sizes_tp = [str(t) for t in (1, 2, 4) if t <= gpus]
        if len(sizes_tp) < 2 or (stage == "70b" and gpus < 4):
            return None
        table = {
            "allreduce": py + ["benchmarks.allreduce", "--tp", *sizes_tp[1:], "--sizes", *map(str, sizes)],
            "70b": py
            + ["benchmarks.tensor_parallel", "--shape", "70b", "--tp", "4", "--overlap-ab", str(overlap)]
            + ["--batch1", "--profile", "--check-prompts", "0"],
            "8b": py + ["benchmarks.tensor_parallel", "--shape", "8b", "--tp", *sizes_tp, "--check-prompts", "0"],
            "correctness": py + ["benchmarks.tensor_parallel", "--correctness", "--tp", *sizes_tp],
        }
    cmd = table[stage]
    if stage == "allreduce":
        return cmd + ["--out", str(work / "allreduce.json")]
    cmd = cmd + ["--json", str(work / f"{stage}.json")]
    return cmd + ar if stage in ("70b", "8b") else cmd


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _run_of(result: Any, tp: int) -> dict[str, Any] | None:
    if not isinstance(result, dict):
        return None
    return next((r for r in result.get("runs", []) if r.get("tp") == tp), None)


def headline(results: dict[str, Any], quick: bool) -> dict[str, Any]:
    """The issue's top-level keys from the stages' results (None where a stage did not deliver)."""
    top: dict[str, Any] = {}
    big_tp = 2 if quick else 4  # the smoke run's "70b" is the embedded model at TP 2
    scaling = results.get("8b")
    run4 = _run_of(scaling, big_tp)
    top[f"scaling_efficiency_tp{big_tp}"] = run4.get("scaling_efficiency") if run4 else None
    if scaling:
        top["scaling_8b"] = [
            {k: r.get(k) for k in ("tp", "tok_s", "speedup", "scaling_efficiency")}
            | {"bound_fraction_overlapped": (r.get("arms") or [{}])[0].get("bound_fraction_overlapped")}
            for r in scaling.get("runs", [])
        ]
    run70 = _run_of(results.get("70b"), big_tp)
    arms = {a["arm"]: a for a in run70.get("arms", [])} if run70 else {}
    best = max(arms.values(), key=lambda a: a["tok_s"]) if arms else None
    key = f"tp{big_tp}_70b"
    top[f"{key}_tok_s"] = best["tok_s"] if best else None
    top[f"{key}_bound_fraction"] = best["bound_fraction_overlapped"] if best else None
    top[f"{key}_arm"] = (
        None
        if best is None
        else "default"
        if best["arm"] == "plain"
        else f"--tensor-parallel-overlap-tokens {best['overlap_tokens']}"
    )
    for name, arm in arms.items():
        top[f"{key}_tok_s_{name}"] = arm["tok_s"]
        top[f"{key}_bound_fraction_{name}"] = arm["bound_fraction_overlapped"]
        top[f"{key}_bound_fraction_serial_{name}"] = arm["bound_fraction_serial"]
    if run70 and "batch1" in run70:
        top[f"{key}_batch1_ms_per_token"] = run70["batch1"]["ms_per_token"]
    nccl_8b = (results.get("8b-nccl") or {}).get("runs", [])  # the scaling curve with every all-reduce on NCCL
    if nccl_8b:
        keys = ("tp", "tok_s", "scaling_efficiency")
        top["scaling_8b_nccl_allreduce"] = [{k: r.get(k) for k in keys} for r in nccl_8b]
    before = _run_of(results.get("70b-nccl"), big_tp)  # the same engine with every all-reduce on NCCL
    for arm in before.get("arms", []) if before else []:
        top[f"{key}_tok_s_{arm['arm']}_nccl_allreduce"] = arm["tok_s"]
        top[f"{key}_bound_fraction_{arm['arm']}_nccl_allreduce"] = arm["bound_fraction_overlapped"]
    if before and "batch1" in before:
        top[f"{key}_batch1_ms_per_token_nccl_allreduce"] = before["batch1"]["ms_per_token"]
    top[f"tp{big_tp}_restart_failed"] = None
    correctness = (results.get("correctness") or {}).get("correctness") or {}
    for dtype, rows in correctness.items():
        for name, row in rows.items():
            if "greedy_vs_first" in row:
                g = row["greedy_vs_first"]
                top.setdefault(f"{dtype}_greedy_identical_vs_tp1", {})[name] = f"{g['identical']}/{g['prompts']}"
                top.setdefault(f"{dtype}_max_abs_logit_diff_vs_tp1", {})[name] = row["logits_vs_first"][
                    "max_abs_logit_diff"
                ]
            if "batch_composition_noise" in row:
                top[f"{dtype}_tp1_batch_composition_max_abs_logit_diff"] = row["batch_composition_noise"][
                    "max_abs_logit_diff"
                ]
    return top


def pytest_summary(log_text: str) -> dict[str, int]:
    """Counts from pytest's last summary line ("3 passed, 1 skipped in 50.1s")."""
    import re

    counts: dict[str, int] = {}
    for line in reversed(log_text.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", line)
        if found and " in " in line:
            for n, what in found:
                counts[what.rstrip("s") if what.startswith("error") else what] = int(n)
            break
    return counts


def device_run(args: argparse.Namespace) -> int:
    import torch

    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    started = time.monotonic()
    deadline = started + args.deadline_s
    args.out.mkdir(parents=True, exist_ok=True)
    slug, gpus = _gpu()
    date = dt.date.today().isoformat()
    final = args.out / f"tp-{slug}x{gpus}-{date}.json"
    tests_log = args.out / f"gpu-tp-tests-{slug}x{gpus}-{date}.log"
    log = Log(args.out / "run.log")
    work = Path(tempfile.mkdtemp(prefix="tp-device-run-"))
    sizes = allreduce_grid()
    summary: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if gpus else "cpu",
        "gpus": gpus,
        "date": date,
        "command": "python -m benchmarks.tp_device_run " + " ".join(args.argv),
        "commit": _commit(),
        "torch": torch.__version__,
        "nccl": _nccl_version(),
        "env": {k: os.environ.get(k) for k in ENV},
        "topology": _topology(),
        "stages": [],
    }
    results: dict[str, Any] = {}

    def save() -> None:
        summary.update(headline(results, args.quick))
        for name in ("allreduce", "70b", "70b-nccl", "8b", "8b-nccl", "correctness"):
            if name in results:
                summary[f"run_{name.replace('-', '_')}" if name[0].isdigit() else name] = results[name]
        final.write_text(json.dumps(summary, indent=2) + "\n")

    save()
    log.line(
        f"issue 36 device run: {summary['gpu']} x {gpus}, stages {' '.join(args.stages)}, deadline {args.deadline_s} s"
    )
    for stage in args.stages:
        left = deadline - time.monotonic()
        cmd = commands(stage, args.quick, gpus, work, sizes, args.overlap_tokens)
        if cmd is None:
            summary["stages"].append({"name": stage, "skipped": f"too few GPUs ({gpus} visible)"})
            save()
            continue
        if left < 20:
            summary["stages"].append({"name": stage, "skipped": f"{left:.0f} s left before the deadline"})
            save()
            continue
        limit = min(left, STAGE_LIMIT_S[stage])
        if stage == "tests":
            with tests_log.open("w", encoding="utf-8") as f:
                f.write(f"# python {' '.join(cmd[1:])} on {summary['gpu']} x {gpus}, {date}\n")
                f.flush()
                row = run_stage(stage, cmd, limit, log, f)
            row["counts"] = pytest_summary(tests_log.read_text(errors="replace"))
            row["log"] = tests_log.name
            summary["gpu_tests"] = row["counts"]
        else:
            row = run_stage(stage, cmd, limit, log, extra_env=STAGE_ENV.get(stage, ("", {}))[1])
            found = _read(work / f"{stage}.json")
            if found is not None:
                results[stage] = found
        summary["stages"].append(row)
        save()
    summary["wall_s"] = round(time.monotonic() - started, 1)
    save()
    failed = [s["name"] for s in summary["stages"] if s.get("rc") not in (0, None) or s.get("skipped")]
    log.line(f"wrote {final} ({summary['wall_s']} s); stages not done or failed: {failed or 'none'}")
    return 1 if failed else 0


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _nccl_version() -> str | None:
    try:
        import torch

        return ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception:  # a torch without NCCL
        return None


def _topology() -> str | None:
    """`nvidia-smi topo -m`: how the GPUs are linked (NVLink / PCIe), which sets the all-reduce bandwidth."""
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def merge(path: Path, pairs: list[str]) -> int:
    """Set top-level keys of a finished run's JSON (e.g. the restart run's tp4_restart_failed)."""
    data = json.loads(path.read_text())
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            print(f"--set takes KEY=VALUE, got {pair!r}", file=sys.stderr)
            return 2
        try:
            data[key] = json.loads(value)
        except ValueError:
            data[key] = value
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"set {', '.join(p.partition('=')[0] for p in pairs)} in {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="where the results and logs go ($OUT on the device)")
    p.add_argument("--quick", action="store_true", help="the CPU smoke run (gloo, embedded model)")
    p.add_argument("--stages", nargs="+", choices=STAGES, help="default: all (without 70b-nccl with --quick)")
    p.add_argument("--deadline-s", type=float, default=540.0, help="seconds before every stage is done or stopped")
    p.add_argument("--overlap-tokens", type=int, default=OVERLAP_TOKENS, help="the 70B run's overlap arm")
    p.add_argument("--merge", type=Path, metavar="FILE", help="set top-level keys of a finished run's JSON")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.merge is not None:
        if not args.set:
            p.error("--merge needs --set KEY=VALUE ...")
        return merge(args.merge, args.set)
    if args.out is None:
        p.error("--out is required (the folder the results go to)")
    if args.stages is None:  # on the CPU both 70b stages sum through gloo: the A/B would measure nothing
        args.stages = [st for st in STAGES if not (args.quick and st in STAGE_ENV)]
    if args.deadline_s <= 0 or args.overlap_tokens < 2:
        p.error("--deadline-s must be > 0 and --overlap-tokens >= 2")
    return device_run(args)


if __name__ == "__main__":
    sys.exit(main())
