"""No request lost when the engine core dies (issue 38): the split server under faults, and what the split costs.

    python -m benchmarks.resume --shape 8b            # one GPU: faults under load, then the throughput A/B
    python -m benchmarks.resume --quick               # CPU smoke run on the embedded model

`faults`: an `opsctl start` deployment with `engine_core = "process"` (engine/loop/) under `--clients` HTTP
clients (streaming or not, kept-alive or new connections, greedy completions of `--max-tokens`), then, in turn, kill
-9 of the engine core, SIGSTOP of the core until the front's silence detector (`health_stall_seconds`) kills it, an
injected fatal device error (`/debug/core-fault?kind=fatal`), and last kill -9 of the front itself (the supervisor
starts a new engine on the socket it holds: the requests in flight then are lost, none refused). Per fault: the
requests in flight when the core ended (the front's `engine_core_ended` line), how many failed, the resume latency
p50/max (from the core's end to each resumed request's next token: the front's `requests_resumed` line), the longest
gap without a completion, and the new core's start. `ab`: the serving benchmark (benchmarks/serving.py) at `--rates`
against a server with `--engine-core thread` and one with `--engine-core process`, alternating thread, process,
thread, process on the same machine; tok/s and median TPOT per mode and their ratio. Results:
`<out>/resume-<gpu>-<date>.json` with top-level `killed_in_flight`, `failed`, `resume_p50_s`, `resume_max_s`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import psutil

from benchmarks.cpu_pair_contention import cpu_model
from benchmarks.restart import (
    FAST_POLICY,
    MODEL,
    REPO,
    RESULTS,
    Deployment,
    Load,
    _free_port,
    archive_logs,
    first_completion,
    model_dir_for,
    window_stats,
)


def core_pid(d: Deployment, not_pid: int | None = None, timeout: float = 600.0) -> int:
    """The engine core process under the deployment's engine (a new one when `not_pid` is the old one's)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        front = d.status().get("engine", {}).get("pid")
        if front:
            try:
                for child in psutil.Process(int(front)).children():
                    if "engine.loop" in " ".join(child.cmdline()) and child.pid != not_pid:
                        return int(child.pid)
            except psutil.Error:
                pass
        time.sleep(0.1)
    raise TimeoutError("no engine core process")


def inject(d: Deployment, fault: str, pid: int) -> None:
    if fault == "kill9":
        os.kill(pid, signal.SIGKILL)
    elif fault == "hang":
        os.kill(pid, signal.SIGSTOP)
    else:
        httpx.post(d.url + "/debug/core-fault", params={"kind": "fatal"}, timeout=10).raise_for_status()


def scenario_faults(d: Deployment, args: argparse.Namespace, stall_s: float) -> dict[str, Any]:
    r = d.opsctl("start", timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"opsctl start failed ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}")
    first_completion(d.url, time.monotonic(), 600)
    load = Load(d.url, args.clients, args.max_tokens).start()
    time.sleep(args.settle)
    windows: list[tuple[str, float, float]] = []
    out: dict[str, Any] = {}
    pid = core_pid(d)
    for fault in ("kill9", "hang", "fatal"):
        ended = len(d.events("engine.log", "engine_core_ended"))
        logged = len(d.events("engine.log", "requests_resumed"))
        t0 = time.monotonic()
        inject(d, fault, pid)
        pid = core_pid(d, not_pid=pid, timeout=stall_s + 600)
        deadline = time.monotonic() + 300
        while len(d.events("engine.log", "requests_resumed")) <= logged and time.monotonic() < deadline:
            time.sleep(0.1)
        t1 = time.monotonic()
        time.sleep(args.settle)
        windows.append((fault, t0, t1 + args.settle))
        end = d.events("engine.log", "engine_core_ended")[ended:]
        resumed = d.events("engine.log", "requests_resumed")[logged:]
        ready = d.events("engine.log", "engine_core_ready")
        out[fault] = {
            "core_end": {k: end[0].get(k) for k in ("reason", "exit_code", "in_flight")} if end else None,
            "resumed": {k: resumed[0].get(k) for k in ("resumed", "p50_s", "max_s", "not_resumed")}
            if resumed
            else None,
            "new_core_start_s": ready[-1].get("seconds") if ready else None,
            "recovered_after_s": round(t1 - t0, 3),
        }
        print(f"  {fault}: {out[fault]}", flush=True)
    # the front itself, kill -9: the supervisor starts a new engine on the socket it holds (nothing resumes these)
    front = int(d.status().get("engine", {}).get("pid") or 0)
    t0 = time.monotonic()
    os.kill(front, signal.SIGKILL)
    first = first_completion(d.url, t0, 900)
    time.sleep(args.settle)
    windows.append(("front_kill9", t0, t0 + first + args.settle))
    out["front_kill9"] = {"first_completion_s": round(first, 3)}
    print(f"  front_kill9: first completion after {first:.2f} s", flush=True)
    records = load.stop()
    for fault, t0, t1 in windows:
        out[fault].update(window_stats(records, t0, t1))
    kill_front = windows[-1][1]
    in_flight = [r for r in records if r.start < kill_front < r.end]
    out["front_kill9"]["in_flight_at_kill"] = len(in_flight)
    out["front_kill9"]["lost"] = sum(1 for r in in_flight if not r.ok)
    out["front_kill9"]["refused"] = sum(1 for r in records if not r.ok and "ConnectError" in r.detail)
    out["all_requests"] = len(records)
    out["all_failed_core_faults"] = sum(1 for r in records if not r.ok and r.end < kill_front)
    d.opsctl("stop", timeout=300)
    return out


def _flags(engine: dict[str, Any]) -> list[str]:
    flags: list[str] = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


def scenario_ab(
    engine: dict[str, Any], args: argparse.Namespace, work: Path, progress: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """The serving benchmark against thread and process servers, alternating, on the same machine; `progress` gets
    the runs so far after each one (a run cut short by a time limit keeps them)."""
    workload = ["--input-len", "256", "--output-len", "128"]
    if args.quick:
        workload = [
            "--input-len",
            "32",
            "--output-len",
            "32",
            "--max-input-len",
            "64",
            "--max-output-len",
            "96",
            "--vocab",
            "300",
        ]
    runs: dict[str, list[Any]] = {"thread": [], "process": []}
    for i, mode in enumerate(("thread", "process") * args.ab_rounds):
        path = work / f"ab-{i}-{mode}.json"
        cmd = [
            sys.executable, "-m", "benchmarks.serving", "--start-server", "--no-plot", "--no-progress",
            "--request-rate", *args.rates, "--num-prompts", str(args.ab_prompts), "--out", str(path),
            "--server-log", str(work / f"ab-{i}-{mode}.log"), *workload,
            "--", *_flags(engine), "--engine-core", mode,
        ]  # fmt: skip
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"serving benchmark ({mode}) failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
        result = json.loads(path.read_text())
        row = [
            {
                "rate": r["request_rate"],
                "tok_s": r["output_throughput"],
                "tpot_median_ms": (r["tpot_ms"] or {}).get("p50"),
                "failed": r["failed"],
            }
            for r in result["runs"]
        ]
        runs[mode].append(row)
        progress({"runs": runs, "prompts_per_rate": args.ab_prompts})
        print(f"  ab {i} {mode}: {row}", flush=True)
    summary = []
    for k, rate in enumerate(args.rates):

        def mean(mode: str, key: str, k: int = k) -> float | None:
            values = [run[k][key] for run in runs[mode] if run[k][key] is not None]
            return round(sum(values) / len(values), 3) if values else None

        t_tok, p_tok = mean("thread", "tok_s"), mean("process", "tok_s")
        t_tpot, p_tpot = mean("thread", "tpot_median_ms"), mean("process", "tpot_median_ms")
        summary.append(
            {
                "rate": rate,
                "thread_tok_s": t_tok,
                "process_tok_s": p_tok,
                "tok_s_ratio": round(p_tok / t_tok, 4) if t_tok and p_tok else None,
                "thread_tpot_ms": t_tpot,
                "process_tpot_ms": p_tpot,
                "tpot_ratio": round(p_tpot / t_tpot, 4) if t_tpot and p_tpot else None,
            }
        )
    return {"runs": runs, "summary": summary, "prompts_per_rate": args.ab_prompts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.resume")
    p.add_argument("--shape", choices=("8b",), default="8b")
    p.add_argument("--quick", action="store_true", help="CPU smoke run on the embedded model")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--settle", type=float, default=5.0, help="seconds of load before and after each fault")
    p.add_argument("--stall-s", type=float, default=None, help="health_stall_seconds (default 5 on a GPU, 4 on CPU)")
    p.add_argument("--skip", default="", help="comma-separated: faults,ab")
    p.add_argument("--rates", nargs="+", default=["16", "inf"], help="the A/B's request rates (default 16 inf)")
    p.add_argument("--ab-prompts", type=int, default=200, help="requests per rate in the A/B (default 200)")
    p.add_argument("--ab-rounds", type=int, default=2, help="thread/process pairs in the A/B (default 2)")
    p.add_argument("--keep-weights", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--logs", default=None, help="also write the engine and supervisor logs here, as one .tar.gz")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    skip = {s for s in args.skip.split(",") if s}
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.quick else "cpu"
    tag = gpu.lower().replace("nvidia ", "").split()[0] if gpu != "cpu" else "cpu"
    out_path = Path(args.out) / f"resume-{tag}-{dt.date.today().isoformat()}.json"
    stall_s = args.stall_s or (4.0 if gpu == "cpu" else 5.0)
    result: dict[str, Any] = {
        "benchmark": "resume",
        "command": "python -m benchmarks.resume " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": dt.date.today().isoformat(),
        "gpu": gpu,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "shape": "embedded" if args.quick else args.shape,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "health_stall_seconds": stall_s,
        "versions": {"torch": torch.__version__},
    }

    def save() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")

    path = model_dir_for(args.shape, args.quick)
    engine: dict[str, Any] = {"model": path, "served_model_name": MODEL, "disable_log_requests": True}
    if args.quick:
        engine.update(device="cpu", max_num_seqs=16)
    else:
        engine["load_format"] = "dummy"
    root = Path(tempfile.mkdtemp(prefix="pagekeeper-resume-"))
    print(f"resume benchmark: {gpu}, shape {result['shape']}, dir {root}", flush=True)
    try:
        if "faults" not in skip:
            print("faults under load (kill -9, hang, fatal error of the engine core)...", flush=True)
            faulty = {**engine, "engine_core": "process", "enable_debug_hooks": True, "health_stall_seconds": stall_s}
            supervisor = {**FAST_POLICY, "keep_weights": "on" if args.quick else args.keep_weights}
            (root / "faults").mkdir()
            d = Deployment(root / "faults", faulty, supervisor, _free_port())
            try:
                faults = scenario_faults(d, args, stall_s)
            finally:
                d.stop()
            result["faults"] = faults
            kill = faults["kill9"]
            result["killed_in_flight"] = (kill.get("core_end") or {}).get("in_flight")
            result["failed"] = faults["all_failed_core_faults"]
            result["resume_p50_s"] = (kill.get("resumed") or {}).get("p50_s")
            result["resume_max_s"] = (kill.get("resumed") or {}).get("max_s")
            save()
        if "ab" not in skip:
            print("throughput: thread vs process, alternating...", flush=True)
            (root / "ab").mkdir()
            result["ab"] = scenario_ab(engine, args, root / "ab", lambda partial: (result.update(ab=partial), save()))
            save()
    finally:
        if args.logs:
            archive_logs(root, args.logs, tag)
        shutil.rmtree(root, ignore_errors=True)
    print(f"wrote {out_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
