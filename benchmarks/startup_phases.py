"""Where an engine server's start-up and exit go: seconds per phase, from a fresh process, as opsctl starts one.

    python -m benchmarks.startup_phases [--repeats 3] [--teardown both|skip|interpreter] [--out benchmarks/results]

Every engine start pays these phases: tests start hundreds (the suite's length follows them), and a restart's
outage on a GPU is the old engine's exit plus the new one's start-up.  Each repeat runs `python -m engine.server`'s
own `main()` with its engine core in the same process (`--engine-core thread`: every phase in one interpreter)
in a fresh interpreter with timing hooks around its phases (importing torch, the server's modules,
`inspect_model`: the checkpoint's config.json, `load_tokenizer`, then building the engine until the server listens),
sends it SIGTERM once it serves, and times SIGTERM to the `stopped` log line (the drain, nothing in flight) and that
line to the process's exit, in wall seconds and in the CPU seconds the exit used (`exit_cpu_s`: what the exit itself
costs, which other work on the cores does not change).  `to_serving_cpu_s` is the CPU the process used until it
served (its threads and reaped children): on a shared host, where other work stretches the wall seconds, it moves
far less.  The host's load averages before and after the runs are recorded with them.  `--teardown interpreter` ends the
child with `sys.exit` (the interpreter's module teardown, what the engine did before it exited without it); `skip`
the way the engine does now (`engine.server.__main__.exit_without_teardown`); `both` alternates them.  The
embedded default model, on the CPU.  `--split on` (the default) alternates each repeat with one of the server as it
runs by default, its engine core in a process of its own: spawn to serving, and the CPU seconds of both processes.

The JSON result goes to `<out>/startup-phases-<YYYY-MM-DD>.json` with the CPU model, the core count, the package
versions and the command line; the last line printed is the same JSON.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.cpu_pair_contention import cpu_model

_CHILD = r"""
import json, os, sys, time
t0 = time.time()
from engine.gc_heap import pause_startup_collections
pause_startup_collections()  # as `python -m engine.server` does before its first import
marks = {}
import torch
marks["import_torch"] = time.time() - t0
import engine.server.__main__ as server_main
import engine.model.loader as loader
import engine.model.tokenizer_load as tokenizer_load
marks["import_engine_server"] = time.time() - t0 - marks["import_torch"]
for module, name in ((loader, "inspect_model"), (tokenizer_load, "load_tokenizer")):
    def timed(*a, _f=getattr(module, name), _n=name, **k):
        t = time.time()
        try:
            return _f(*a, **k)
        finally:
            marks[_n] = time.time() - t
    setattr(module, name, timed)
startup = server_main.DrainOnTermServer.startup
async def announce(self, sockets=None):
    await startup(self, sockets)
    marks["to_serving"] = time.time() - t0
    cpu = os.times()
    marks["to_serving_cpu_s"] = cpu.user + cpu.system + cpu.children_user + cpu.children_system
    print("STARTUP " + json.dumps(marks), flush=True)
server_main.DrainOnTermServer.startup = announce
code = server_main.main(["--port", sys.argv[1], "--engine-core", "thread"])  # every phase in this process
cpu = os.times()
print(f"EXITING {cpu.user + cpu.system + cpu.children_user + cpu.children_system:.4f}", flush=True)
if sys.argv[2] == "skip":
    server_main.exit_without_teardown(code)
sys.exit(code)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_with_cpu(p: subprocess.Popen[str], timeout: float) -> tuple[int, float]:
    """Reap the child and return its exit code and the CPU seconds (user + system) it used in all, with those of the
    children it reaped (a kernel build at start-up), as the child's own `os.times()` counts them.

    The exit's CPU seconds, unlike its wall seconds, do not grow when other work shares the cores: the comparison
    of the two exits holds on a loaded CI machine, where one run's wall time can swing by half a second.
    """
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            p.returncode = os.waitstatus_to_exitcode(status)
            return p.returncode, usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(p.args, timeout)
        time.sleep(0.01)


def one_run(teardown: str) -> dict[str, Any]:
    """Start, serve, SIGTERM, exit: the phases of one engine process, in seconds."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.time()
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(_free_port()), teardown],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert p.stdout is not None
    row: dict[str, Any] = {"teardown": teardown}
    try:
        for line in p.stdout:
            if line.startswith("STARTUP "):
                row.update({k: round(v, 3) for k, v in json.loads(line[8:]).items()})
                break
        else:
            raise RuntimeError(f"the engine exited before serving (exit code {p.wait()})")
        row["spawn_to_serving"] = round(time.time() - started, 3)
        row["build_engine_and_listen"] = round(
            row["to_serving"]
            - row["import_torch"]
            - row["import_engine_server"]
            - row["inspect_model"]
            - row["load_tokenizer"],
            3,
        )
        sent = time.monotonic()
        p.send_signal(signal.SIGTERM)
        stopped = None
        cpu_at_exit_start = None
        for line in p.stdout:
            if stopped is None and '"event": "stopped"' in line:
                stopped = time.monotonic()
            elif line.startswith("EXITING "):
                cpu_at_exit_start = float(line.split()[1])
        returncode, cpu_total = _wait_with_cpu(p, timeout=60)
        ended = time.monotonic()
        if stopped is None or cpu_at_exit_start is None:
            raise RuntimeError("the engine exited without its `stopped` line")
        row["sigterm_to_stopped"] = round(stopped - sent, 3)
        row["stopped_to_exit"] = round(ended - stopped, 3)
        row["exit_cpu_s"] = round(cpu_total - cpu_at_exit_start, 3)
        row["exit_code"] = returncode
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return row


def one_split_run() -> dict[str, Any]:
    """The server as it runs by default, its engine core in a process of its own (`--engine-core process`): spawn to
    the `serving` line, the CPU seconds of the front and the core until then, SIGTERM to the front's exit."""
    import psutil

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.time()
    p = subprocess.Popen(
        [sys.executable, "-m", "engine.server", "--port", str(_free_port()), "--engine-core", "process"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert p.stdout is not None
    row: dict[str, Any] = {"engine_core": "process"}
    try:
        for line in p.stdout:
            if line.startswith("{") and '"event": "engine_core_ready"' in line:
                row["core_spawn_to_ready"] = round(float(json.loads(line)["seconds"]), 3)
            if line.startswith("{") and '"event": "serving"' in line:
                break
        else:
            raise RuntimeError(f"the engine exited before serving (exit code {p.wait()})")
        row["spawn_to_serving"] = round(time.time() - started, 3)
        front = psutil.Process(p.pid)
        cores = front.children(recursive=True)
        row["front_cpu_s"] = round(sum(front.cpu_times()[:2]), 3)
        row["core_cpu_s"] = round(sum(sum(c.cpu_times()[:2]) for c in cores), 3)
        row["to_serving_cpu_s"] = round(row["front_cpu_s"] + row["core_cpu_s"], 3)
        sent = time.monotonic()
        p.send_signal(signal.SIGTERM)
        for _ in p.stdout:
            pass
        row["exit_code"] = p.wait(timeout=60)
        row["sigterm_to_exit"] = round(time.monotonic() - sent, 3)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return row


def _cpu_id() -> str:
    """Vendor, family, model and stepping from /proc/cpuinfo (a virtual machine's model name can be as short as
    "AMD EPYC"; family 25 model 1 is then Zen 3, Milan)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "cpu family", "model", "stepping") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:
                    break
    except OSError:
        return ""
    return ", ".join(f"{k} {v}" for k, v in fields.items())


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "tokenizers", "uvicorn"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "absent"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--teardown", choices=("both", "skip", "interpreter"), default="both")
    ap.add_argument("--out", default="benchmarks/results", help="directory for the JSON result ('' = print only)")
    ap.add_argument(
        "--split",
        choices=("on", "off"),
        default="on",
        help="also time the default server (its engine core in its own process), alternating with the others",
    )
    args = ap.parse_args(argv)
    modes = ["skip", "interpreter"] if args.teardown == "both" else [args.teardown]
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    split_rows: list[dict[str, Any]] = []
    for _ in range(args.repeats):  # alternating, one machine
        rows += [one_run(mode) for mode in modes]
        if args.split == "on":
            split_rows.append(one_split_run())
    load_after = os.getloadavg()
    medians: dict[str, dict[str, float]] = {}
    for mode in modes:
        mine = [r for r in rows if r["teardown"] == mode]
        keys = [k for k, v in mine[0].items() if isinstance(v, float)]
        medians[mode] = {k: round(statistics.median(r[k] for r in mine), 3) for k in keys}
    if split_rows:
        keys = [k for k, v in split_rows[0].items() if isinstance(v, float)]
        medians["split"] = {k: round(statistics.median(r[k] for r in split_rows), 3) for k in keys}
    result = {
        "benchmark": "startup_phases",
        "date": _dt.date.today().isoformat(),
        "command": "python -m benchmarks.startup_phases " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "cpu": cpu_model(),
        "cpu_id": _cpu_id(),
        "cores": os.cpu_count(),
        "load_average_1_5_15_min": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in load_after],
        },
        "versions": _versions(),
        "model": "embedded default",
        "medians": medians,
        "rows": rows,
        "split_rows": split_rows,
    }
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"startup-phases-{result['date']}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    for mode, m in medians.items():
        print(f"{mode:>11}: " + ", ".join(f"{k} {v:.2f} s" for k, v in m.items()), file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
