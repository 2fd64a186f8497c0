"""What OpenMP's wait policy costs a CPU engine server, alone and beside busy processes.

    python -m benchmarks.openmp_waits [--policies default,passive,libgomp-default,active,active-N,spin-N]
                                      [--busy 0,2] [--requests 10] [--clients 1] [--max-tokens 32]
                                      [--model DIR] [--dtype D] [--out benchmarks/results]

For each policy one real server (`python -m engine.server`) is started; for each `--busy` count that many
processes spinning in a loop are started beside it (the other work of a shared host: clients, a supervisor, a
second engine during a handover, a test suite), and `--clients` clients each send `--requests` completions of
`--max-tokens` tokens (ignore_eos) one after another, to a short text prompt or (`--prompt-tokens N`) N token ids.
Reported per run: wall seconds, the server's CPU seconds (user + system, from /proc, its engine core's process
included), tokens, both per token, and wall time per request.

Policies: `default` is the engine's own (engine/openmp_waits.py: a short spin when the operator set no wait knob);
`passive` is OMP_WAIT_POLICY=PASSIVE (never spin; the engine's default until 2026-11-29); `libgomp-default` is
GOMP_SPINCOUNT=300000 (libgomp's own spin when OMP_WAIT_POLICY is unset, cut to 1,000 rounds where libgomp counts
more of its threads than cores); `active` is OMP_WAIT_POLICY=ACTIVE (spin without end); `spin-N` is
GOMP_SPINCOUNT=N; `active-N` is OMP_WAIT_POLICY=ACTIVE with GOMP_SPINCOUNT=N (spin N rounds, never cut, then sleep).

JSON: `<out>/openmp-waits-cpu-<YYYY-MM-DD>.json`, with the CPU model, the core count and the command line.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.cpu_pair_contention import cpu_model
from benchmarks.serving import free_port
from engine.openmp_waits import WAIT_KNOBS

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
POLICY_ENV = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "libgomp-default": {"GOMP_SPINCOUNT": "300000"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}
SPIN = "while True: pass"


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _tree_cpu_seconds(pid: int) -> float:
    """The CPU of `pid` and every process below it: the server's front and its engine core (engine/loop/)."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in (root, *root.children(recursive=True)):
        try:
            total += _cpu_seconds(proc.pid)
        except psutil.NoSuchProcess:
            continue  # a process that ended while the tree was read
    return total


COUNTED_POLICIES = ("spin-", "active-")  # policy names that end in a spin count


def _policy_env(policy: str) -> dict[str, str]:
    """A named policy's settings; `spin-N`: GOMP_SPINCOUNT=N; `active-N`: the same with OMP_WAIT_POLICY=ACTIVE."""
    if policy.startswith("spin-"):
        return {"GOMP_SPINCOUNT": policy.removeprefix("spin-")}
    if policy.startswith("active-"):
        return {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": policy.removeprefix("active-")}
    return POLICY_ENV[policy]


def _start_server(policy: str, model: str | None, dtype: str | None, log: Path) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_KNOBS}
    env.update(_policy_env(policy))
    port = free_port()
    cmd = [sys.executable, "-m", "engine.server", "--port", str(port)] + (["--model", model] if model else [])
    cmd += ["--dtype", dtype] if dtype else []
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server was not ready in 180 s: {log.read_text()[-2000:]}")


def _prompt(i: int, prompt_tokens: int) -> str | list[int]:
    """Request i's prompt: a short text, or `prompt_tokens` token ids, different per request (no prefix is cached)
    and below 380 (the embedded default model's vocabulary is 384)."""
    if prompt_tokens <= 0:
        return f"request {i}: hello there"
    return [3 + (i * 7919 + j * 104729) % 377 for j in range(prompt_tokens)]


def _client(url: str, model: str, requests: int, max_tokens: int, prompt_tokens: int = 0, first: int = 0) -> int:
    tokens = 0
    with httpx.Client(timeout=300) as c:
        for i in range(first, first + requests):
            body = {"model": model, "prompt": _prompt(i, prompt_tokens), "max_tokens": max_tokens, "ignore_eos": True}
            r = c.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            tokens += int(r.json()["usage"]["completion_tokens"])
    return tokens


def measure(url: str, pid: int, clients: int, requests: int, max_tokens: int, prompt_tokens: int = 0) -> dict[str, Any]:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    _client(url, model, 1, 4, prompt_tokens, first=10**6)  # warm-up
    cpu0, t0 = _tree_cpu_seconds(pid), time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        run = lambda c: _client(url, model, requests, max_tokens, prompt_tokens, first=c * requests)  # noqa: E731
        tokens = sum(pool.map(run, range(clients)))
    wall, cpu = time.perf_counter() - t0, _tree_cpu_seconds(pid) - cpu0
    return {
        "wall_s": round(wall, 3),
        "server_cpu_s": round(cpu, 3),
        "tokens": tokens,
        "ms_per_token": round(wall / tokens * 1e3, 3),
        "cpu_ms_per_token": round(cpu / tokens * 1e3, 3),
        "ms_per_request": round(wall / (clients * requests) * 1e3, 3),
    }


def _names(text: str, allowed: dict[str, Any], flag: str, p: argparse.ArgumentParser) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]

    def counted(n: str) -> bool:
        return any(n.startswith(pre) and n[len(pre) :].isdigit() for pre in COUNTED_POLICIES)

    bad = [n for n in names if n not in allowed and not counted(n)]
    if bad or not names:
        p.error(
            f"{flag}: unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(allowed)}, spin-N or active-N"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default="default,passive,libgomp-default,active")
    p.add_argument("--busy", default="0,2", help="comma-separated counts of spinning processes beside the server")
    p.add_argument("--requests", type=int, default=10, help="completions per client")
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=0, help="prompts of this many token ids (0: a short text)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--dtype", default=None, help="the server's --dtype (default: the checkpoint's)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    policies = _names(args.policies, POLICY_ENV, "--policies", p)
    try:
        busy = [int(b) for b in args.busy.split(",")]
    except ValueError:
        p.error(f"--busy: comma-separated counts, not {args.busy!r}")
    counts = (("--requests", args.requests), ("--clients", args.clients), ("--max-tokens", args.max_tokens))
    if args.prompt_tokens < 0:
        p.error(f"--prompt-tokens must be 0 or more, not {args.prompt_tokens}")
    for flag, value in counts:
        if value < 1:
            p.error(f"{flag} must be at least 1, not {value}")
    if any(b < 0 for b in busy):
        p.error(f"--busy counts must be 0 or more, not {args.busy}")

    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for policy in policies:
        proc, url = _start_server(policy, args.model, args.dtype, args.out / f".openmp-waits-{policy}.log")
        try:
            for n in busy:
                spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
                try:
                    result = measure(url, proc.pid, args.clients, args.requests, args.max_tokens, args.prompt_tokens)
                finally:
                    for s in spinners:
                        s.kill()
                        s.wait()
                runs.append({"policy": policy, "busy_processes": n, **result})
                print(json.dumps(runs[-1]), flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            (args.out / f".openmp-waits-{policy}.log").unlink(missing_ok=True)
    out = args.out / f"openmp-waits-cpu-{_dt.date.today().isoformat()}.json"
    given = argv if argv is not None else sys.argv[1:]
    out.write_text(
        json.dumps(
            {
                "command": "python -m benchmarks.openmp_waits " + shlex.join(given),
                "cpu": cpu_model(),
                "cores": len(os.sched_getaffinity(0)),
                "date": _dt.date.today().isoformat(),
                "clients": args.clients,
                "requests_per_client": args.requests,
                "max_tokens": args.max_tokens,
                "prompt_tokens": args.prompt_tokens or "a short text",
                "model": args.model or "embedded default",
                "dtype": args.dtype or "checkpoint's",
                "runs": runs,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
