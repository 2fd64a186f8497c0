"""What a supervised engine that serves nothing costs in CPU: the supervisor, the engine's front and its core.

    python -m benchmarks.idle_cpu [--poll-interval 0.5] [--seconds 30] [--repeats 2] [--out benchmarks/results]

Why: on a CPU host the engine's processes share the cores with the model, and the test suite runs dozens of
supervised engines at its fast poll (0.5 s, tests/opsctl/harness.py): what one costs while it waits is paid by
every other one.  Each repeat starts the embedded model with `opsctl start` (process launcher, a private runtime
dir, a free port, the tests' fast supervisor settings with `--poll-interval`), waits until it serves, then reads
each process's CPU seconds (user + system) over `--seconds` of idleness and stops it.  The JSON result goes to
`<out>/idle-cpu-<YYYY-MM-DD>.json` with the CPU model and the commit; the last line printed is the same JSON.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.cpu_pair_contention import cpu_model
from tests.opsctl.harness import deployment

REPO = Path(__file__).resolve().parent.parent
CORE_MODULE = "engine.loop"


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def one_repeat(poll_interval: float, seconds: float) -> dict[str, float]:
    """CPU percent of one core, per process, of one idle supervised engine."""
    with tempfile.TemporaryDirectory(prefix="idle-cpu-") as tmp:
        d = deployment(Path(tmp), supervisor={"poll_interval": poll_interval})
        try:
            r = d.opsctl("start")
            if r.returncode != 0:
                raise RuntimeError(f"opsctl start exited {r.returncode}: {r.stdout}{r.stderr}")
            time.sleep(max(2.0, 2 * poll_interval))  # past the first polls and the start-up work
            st = d.status()
            front = psutil.Process(st["engine"]["pid"])
            procs = {"supervisor": psutil.Process(st["supervisor"]["pid"]), "front": front}
            cores = [c for c in front.children(recursive=True) if CORE_MODULE in " ".join(c.cmdline())]
            if cores:
                procs["core"] = cores[0]
            before = {name: _cpu_s(p) for name, p in procs.items()}
            time.sleep(seconds)
            return {name: round((_cpu_s(p) - before[name]) / seconds * 100, 3) for name, p in procs.items()}
        finally:
            d.teardown()


def _git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=str(REPO))
    return r.stdout.strip()


def run(poll_interval: float, seconds: float, repeats: int) -> dict[str, Any]:
    runs = [one_repeat(poll_interval, seconds) for _ in range(repeats)]
    names = sorted({name for r in runs for name in r})
    median = {name: round(statistics.median(r[name] for r in runs if name in r), 3) for name in names}
    return {
        "benchmark": "idle_cpu",
        "date": _dt.date.today().isoformat(),
        "command": [sys.executable, "-m", "benchmarks.idle_cpu", *sys.argv[1:]],
        "cpu": cpu_model(),
        "commit": _git_commit(),
        "poll_interval_s": poll_interval,
        "seconds": seconds,
        "cpu_percent_median": median,
        "cpu_percent_total_median": round(sum(median.values()), 3),
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.idle_cpu")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="the supervisor's (default 0.5: the tests')")
    parser.add_argument("--seconds", type=float, default=30.0, help="idle seconds measured per repeat (default 30)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.poll_interval <= 0 or args.seconds <= 0 or args.repeats < 1:
        parser.error("--poll-interval and --seconds must be > 0 and --repeats >= 1")
    result = run(args.poll_interval, args.seconds, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"idle-cpu-{result['date']}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
