"""Where a command's CPU goes, by kind of process: engines, supervisors, opsctl calls, pytest workers, compilers.

    python -m benchmarks.suite_cpu [--out benchmarks/results] [--interval 0.5] -- python3 -m pytest -n 3 --dist loadfile

Why: the test suite is CPU-bound on the 2-core build machine (the cores were 94 % busy in
`suite-cpu-2026-11-27.json`), so its length follows the CPU its processes use, and most of them are not the pytest
workers but what the tests start: engine servers, supervisors (daemonized, so the command's own rusage never sees
them), opsctl calls, compilers.  The command runs as a child; every `interval` seconds every process on the host is
read through psutil (its command line once, its CPU seconds each time), and at the end each process's CPU seconds
(less what it had used before the command started) are summed by kind: run it on an otherwise quiet host, since
every process there counts.  A process that lives less than one interval is missed; `host_busy_cpu_s` (the host's
CPU times over the run) is the whole, so `sampled_cpu_s / host_busy_cpu_s` says how much was seen.

The JSON result goes to `<out>/suite-cpu-<YYYY-MM-DD>.json` with the command, its exit status and wall seconds;
the last line printed is the same JSON.  `by_test_file` sums the same CPU seconds by the test file that started
each process (its PYTEST_CURRENT_TEST): which files' deployments cost the most; `by_test_top` the TOP_TESTS tests
whose processes used the most.  The pytest workers' own CPU by test comes from tests/cpu_report.py (the command
runs with PAGEKEEPER_TEST_CPU_LOG set): `in_process_by_test_file`, `in_process_top`, and `total_by_test_file`, the
two summed per file.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

_KINDS = (  # (kind, any of these in the command line), first match wins; paths may hold any word, so modules
    ("engine server", ("-m engine.server ",)),
    ("supervisor", ("-m opsctl.supervisor ",)),
    ("opsctl call", ("-m opsctl.cli ",)),
    ("soak runner", ("-m tests.opsctl.soak ",)),
    ("spawned worker (tensor-parallel ranks)", ("from multiprocessing.spawn", "from multiprocessing.forkserver")),
    ("pytest worker", ("exec(eval(sys.stdin.readline()))",)),
    ("pytest", ("-m pytest ",)),
)
TOP_TESTS = 60  # tests listed by what their processes used (by_test_top)
_COMPILERS = {"cc1plus", "cc1", "collect2", "ld", "as", "c++", "g++", "gcc", "cc", "ninja"}


def kind_of(cmdline: str) -> str:
    """The kind of process a command line belongs to; a python script or module by its name otherwise."""
    if not cmdline.strip():
        return "kernel thread or unreadable"
    for kind, needles in _KINDS:
        if any(n in cmdline + " " for n in needles):
            return kind
    words = cmdline.split()
    exe = os.path.basename(words[0])
    if exe in ("pytest", "py.test"):
        return "pytest"
    if exe in ("opsctl",):
        return "opsctl call"
    if exe in _COMPILERS or exe.endswith(("-g++", "-gcc", "-ld")):
        return "compiler"
    if exe.startswith("python") and len(words) > 1:
        target = words[2] if words[1] == "-m" and len(words) > 2 else words[1]
        return f"python {os.path.basename(target)}"
    return exe


def _test_of(proc: psutil.Process) -> str:
    """The test that started `proc`: pytest sets PYTEST_CURRENT_TEST in its worker's environment for
    each test's setup, call and teardown, and every process a test starts (servers, their cores, supervisors)
    inherits it.  "" when none (the pytest processes themselves, anything else on the host)."""
    try:
        current = proc.environ().get("PYTEST_CURRENT_TEST", "")
    except psutil.Error:
        return ""
    return current.rsplit(" (", 1)[0]  # "tests/x.py::test_y[case] (call)": the test, whichever of its phases


def _host_busy_seconds() -> float:
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


class Sampler:
    """Per-process CPU seconds since `start()`, keyed by (pid, start time) so that a reused pid is a new process."""

    def __init__(self) -> None:
        self.before: dict[tuple[int, float], float] = {}
        self.last: dict[tuple[int, float], float] = {}
        self.kinds: dict[tuple[int, float], str] = {}
        self.tests: dict[tuple[int, float], str] = {}

    def _scan(self) -> dict[tuple[int, float], float]:
        seen = {}
        for proc in psutil.process_iter(["create_time", "cpu_times", "cmdline"]):
            info = proc.info
            if info["create_time"] is None or info["cpu_times"] is None:  # gone or unreadable meanwhile
                continue
            key = (proc.pid, info["create_time"])
            seen[key] = info["cpu_times"].user + info["cpu_times"].system
            # the latest command line: a fork keeps its parent's until it execs (same pid and start time), and a
            # process seen between the two was counted as its parent; an exited one (a zombie) reads none
            if info["cmdline"] or key not in self.kinds:
                self.kinds[key] = kind_of(" ".join(info["cmdline"] or []))
            if key not in self.tests:
                self.tests[key] = _test_of(proc)
        return seen

    def start(self) -> None:
        self.before = self._scan()

    def sample(self) -> None:
        self.last.update(self._scan())

    def used_by_kind(self) -> tuple[Counter[str], Counter[str]]:
        """CPU seconds and processes by kind, unrounded."""
        cpu: Counter[str] = Counter()
        count: Counter[str] = Counter()
        for key, seconds in self.last.items():
            used = seconds - self.before.get(key, 0.0)
            if used > 0:
                cpu[self.kinds[key]] += used
                count[self.kinds[key]] += 1
        return cpu, count

    def by_test(self, file_only: bool, top: int | None = None) -> dict[str, dict[str, float]]:
        """CPU seconds and processes by the test (or its file) that started them, most first; pytest workers' own
        work is not here (`--durations` says that)."""
        cpu: Counter[str] = Counter()
        count: Counter[str] = Counter()
        for key, seconds in self.last.items():
            used, test = seconds - self.before.get(key, 0.0), self.tests.get(key, "")
            if used > 0 and test:
                name = test.split("::", 1)[0] if file_only else test
                cpu[name] += used
                count[name] += 1
        return {k: {"cpu_s": round(v, 1), "processes": count[k]} for k, v in cpu.most_common(top)}

    def by_kind(self) -> dict[str, dict[str, float]]:
        cpu, count = self.used_by_kind()
        return {k: {"cpu_s": round(v, 1), "processes": count[k]} for k, v in cpu.most_common()}


CPU_LOG_ENV = "PAGEKEEPER_TEST_CPU_LOG"  # tests/cpu_report.py's variable


def in_process_by_test(log_dir: Path) -> Counter[str]:
    """CPU seconds each test used inside its pytest process, from tests/cpu_report.py's lines (all workers)."""
    used: Counter[str] = Counter()
    for path in log_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            used[row["test"]] += row["cpu_s"]
    return used


def _rows(cpu: Counter[str], top: int | None = None) -> dict[str, dict[str, float]]:
    return {k: {"cpu_s": round(v, 1)} for k, v in cpu.most_common(top)}


def run(command: list[str], interval: float) -> dict[str, Any]:
    sampler = Sampler()
    busy0 = _host_busy_seconds()  # before the first scan: what the scan reads as the start is inside the host's whole
    sampler.start()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as log_dir:
        child = subprocess.Popen(command, env={**os.environ, CPU_LOG_ENV: log_dir})
        while child.poll() is None:
            sampler.sample()
            time.sleep(interval)
        sampler.sample()
        in_process = in_process_by_test(Path(log_dir))
    wall, busy = time.monotonic() - started, _host_busy_seconds() - busy0
    kinds = sampler.by_kind()
    in_process_files: Counter[str] = Counter()
    for test, seconds in in_process.items():
        in_process_files[test.split("::", 1)[0]] += seconds
    children_files = Counter({k: v["cpu_s"] for k, v in sampler.by_test(file_only=True).items()})
    sampled = sum(sampler.used_by_kind()[0].values())  # not the kinds' rounded figures: a host runs many kinds
    return {
        "benchmark": "suite_cpu",
        "date": _dt.date.today().isoformat(),
        "command": command,
        "exit_status": child.returncode,
        "cores": os.cpu_count(),
        "wall_s": round(wall, 1),
        "host_busy_cpu_s": round(busy, 1),
        "host_busy_fraction": round(busy / (wall * (os.cpu_count() or 1)), 3),
        "sampled_cpu_s": round(sampled, 1),
        "interval_s": interval,
        "by_kind": {
            k: {**v, "share_of_sampled": round(v["cpu_s"] / sampled, 3) if sampled else 0.0} for k, v in kinds.items()
        },
        "by_test_file": sampler.by_test(file_only=True),
        "by_test_top": sampler.by_test(file_only=False, top=TOP_TESTS),
        "in_process_cpu_s": round(sum(in_process.values()), 1),
        "in_process_by_test_file": _rows(in_process_files),
        "in_process_top": _rows(in_process, TOP_TESTS),
        "total_by_test_file": _rows(in_process_files + children_files),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m benchmarks.suite_cpu [--out DIR] [--interval S] -- COMMAND...", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite_cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--interval", type=float, default=0.5, help="Seconds between scans of the processes.")
    args = parser.parse_args(argv[:split])
    if args.interval <= 0 or not argv[split + 1 :]:
        parser.error("--interval must be > 0 and a command must follow --")
    result = run(argv[split + 1 :], args.interval)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"suite-cpu-{result['date']}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0 if result["exit_status"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
