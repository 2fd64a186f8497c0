"""Where `opsctl start` spends its time before the engine process exists: the CLI's interpreter, then the supervisor's.

    python -m benchmarks.opsctl_start [--repeats 5] [--out benchmarks/results] [--name NAME]

Every start, restart of the supervisor and CI test pays these seconds before the engine even begins its own
start-up (benchmarks/startup_phases.py times that part).  Each repeat runs, in fresh interpreters from the
repository root:

- `python -c pass`: the interpreter and site alone, the floor under everything else;
- `python -m opsctl --help`, `python -c 'import opsctl.cli'`, `python -c 'import opsctl.supervisor'`: the two entry
  modules' imports, in wall seconds and in the CPU seconds the process used (CPU moves far less than wall when other
  work shares the cores);
- `python -m opsctl start` with a private runtime dir, a free port and the process launcher, followed until the
  supervisor writes engine.json (the engine's pid), then killed with its supervisor and engine:
  `cli_to_supervisor_s` is the CLI's process creation to the supervisor's (import, parse, config, runtime dir),
  `supervisor_to_engine_s` the supervisor's creation to the engine's (import, config, lock, probes, metrics, the
  listening socket, the spawn).  Creation times are the kernel's (/proc, 10 ms ticks), not this process's polling.

The modules the entry modules leave loaded, out of a list of heavy ones, are recorded beside the times.  The JSON
result goes to `<out>/<name>.json` (default `opsctl-start-<YYYY-MM-DD>`) with the CPU model, the core count, the
load averages, the git commit and the command line; the last line printed is the same JSON.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.cpu_pair_contention import cpu_model
from tests.server.harness import free_port

REPO = Path(__file__).resolve().parent.parent

# Modules a CLI or a supervisor process may load, heavy enough to show in its start-up (`python -X importtime`).
HEAVY = (
    "rich",
    "torch",
    "numpy",
    "transformers",
    "httpx",
    "prometheus_client",
    "pydantic",
    "jinja2",
    "structlog",
    "psutil",
    "asyncio",
    "importlib.metadata",
)

IMPORTS = {
    "interpreter": ["-c", "pass"],
    "cli_help": ["-m", "opsctl", "--help"],
    "import_cli": ["-c", "import opsctl.cli"],
    "import_supervisor": ["-c", "import opsctl.supervisor"],
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def timed_process(args: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds (user + system, the child's own rusage) of `python ARGS` run to its exit."""
    started = time.perf_counter()
    p = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, cwd=REPO, env=_env())
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - started
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"python {shlex.join(args)} exited {p.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


def loaded_heavy(module: str) -> list[str]:
    """Which of HEAVY a fresh interpreter holds after `import MODULE`."""
    code = f"import json, sys, {module}; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=_env(), check=True)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def _write_config(path: Path, port: int) -> None:
    path.write_text(f'[engine]\nport = {port}\n\n[supervisor]\nmetrics_port = 0\nlauncher = "process"\n')


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _kill(pid: int | None, group: bool = False) -> None:
    if pid is None:
        return
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def start_to_spawn(timeout: float = 120) -> dict[str, float]:
    """One `opsctl start`, from the CLI's creation to the engine's; the three processes are killed after."""
    with tempfile.TemporaryDirectory(prefix="opsctl-start-") as tmp:
        root = Path(tmp)
        runtime = root / "run"
        config = root / "pagekeeper.toml"
        _write_config(config, free_port())
        cli = subprocess.Popen(
            [sys.executable, "-m", "opsctl", "--config", str(config), "--runtime-dir", str(runtime), "start"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=_env(),
        )
        supervisor_pid = engine_pid = None
        try:
            cli_created = psutil.Process(cli.pid).create_time()
            deadline = time.monotonic() + timeout
            while engine_pid is None:
                record = _read_json(runtime / "engine.json")
                if record is not None:
                    engine_pid = int(record["pid"])
                    break
                if cli.poll() is not None or time.monotonic() > deadline:
                    log = (runtime / "supervisor.log").read_text(errors="replace") if runtime.exists() else ""
                    raise RuntimeError(f"no engine was spawned: {cli.stderr.read() if cli.stderr else ''}{log[-2000:]}")
                time.sleep(0.02)
            supervisor_pid = int((runtime / "supervisor.pid").read_text())
            supervisor_created = psutil.Process(supervisor_pid).create_time()
            engine_created = psutil.Process(engine_pid).create_time()
        finally:
            _kill(supervisor_pid)
            _kill(engine_pid, group=True)
            cli.kill()
            cli.communicate()
            psutil.wait_procs([p for p in map(_process, (supervisor_pid, engine_pid)) if p is not None], timeout=30)
    return {
        "cli_to_supervisor_s": round(supervisor_created - cli_created, 3),
        "supervisor_to_engine_s": round(engine_created - supervisor_created, 3),
        "cli_to_engine_s": round(engine_created - cli_created, 3),
    }


def _process(pid: int | None) -> psutil.Process | None:
    try:
        return psutil.Process(pid) if pid is not None else None
    except psutil.Error:
        return None


def one_repeat() -> dict[str, float]:
    row: dict[str, float] = {}
    for name, args in IMPORTS.items():
        wall, cpu = timed_process(args)
        row[f"{name}_s"], row[f"{name}_cpu_s"] = round(wall, 3), round(cpu, 3)
    row.update(start_to_spawn())
    return row


def _git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "opsctl", "engine"], capture_output=True, text=True)
    return r.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results", help="directory for the JSON result ('' = print only)")
    ap.add_argument("--name", default=None, help="result file name without .json (default opsctl-start-<date>)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    load_before = os.getloadavg()
    for warm_up in IMPORTS.values():  # once untimed: the bytecode caches are written, not measured
        timed_process(warm_up)
    rows = [one_repeat() for _ in range(args.repeats)]
    load_after = os.getloadavg()
    medians = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
    date = _dt.date.today().isoformat()
    result = {
        "benchmark": "opsctl_start",
        "date": date,
        "command": "python -m benchmarks.opsctl_start " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "git_commit": _git_commit(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "load_average_1_5_15_min": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in load_after],
        },
        "heavy_modules_loaded": {m: loaded_heavy(m) for m in ("opsctl.cli", "opsctl.supervisor")},
        "medians": medians,
        "rows": rows,
    }
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{args.name or 'opsctl-start-' + date}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    figures = ", ".join(f"{k} {v:.3f}" for k, v in medians.items())
    print(f"medians of {args.repeats}: {figures}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
