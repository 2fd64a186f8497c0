"""Online serving benchmark: a load generator against pagekeeper's OpenAI-compatible HTTP server.

Why it exists: `benchmarks/cpu_offline.py` measures `LLM.generate` throughput in one process, which
says nothing about what a client of the server sees.  This script measures that: time to first
token (TTFT), time per output token (TPOT), inter-token latency (ITL) and end-to-end latency under
Poisson arrivals at several request rates (or at a fixed number of requests in flight), the way
vLLM's `benchmark_serving.py` does, so the numbers can be compared with vLLM's.

Reproduce (on the GPU machine; everything after `--` goes to `python -m engine.server`):

    python3 -m benchmarks.serving --start-server --request-rate 2 4 8 --num-prompts 200 \\
        -- --model MODEL_DIR --load-format dummy --dtype bfloat16 --max-model-len 2048

or against a server that is already running on this machine:

    python3 -m benchmarks.serving --url http://127.0.0.1:8000 --concurrency 1 8 32

and, to redraw the PNG from a result fetched from another machine:

    python3 -m benchmarks.serving --plot-only benchmarks/results/serving-nvidia-h200-YYYY-MM-DD.json

Workload: synthetic prompts sent as token ids (`prompt: [ids]` on POST /v1/completions) with
`temperature: 0`, `ignore_eos: true` (so each request yields exactly its `max_tokens`), `stream: true`
and `stream_options.include_usage`.  Input and output lengths are long-tailed: lognormal with the
given medians (`--input-len`, `--output-len`) and spread (`--len-sigma`, the sigma of the log), capped
at `--max-input-len` / `--max-output-len`.  Token ids are uniform in [`--min-token-id`, `--vocab`).
Everything is seeded (`--seed`): every run sees the same lengths and the same arrival pattern
(scaled by its rate), but fresh token ids, so prefix caching cannot reuse an earlier run's prompts.

Metrics (per run, latencies in ms): TTFT = first SSE chunk with a choice (the server
sends one as soon as a token exists, text or not) - send; TPOT = (e2e - TTFT) /
(output tokens - 1); ITL = gaps between consecutive chunks after the first (a chunk that carries
several tokens counts as one gap, as in vLLM); e2e = last byte - send; output tokens come from the
usage chunk.  Throughputs divide by the run's duration (first send to last response).

Bounds: every request has `--request-timeout`, and the whole benchmark (warm-up and every run, not
the server start-up, which has `--server-timeout`) stops at `--max-duration`; what is cut off is
reported as failed / not sent.  A server started with `--start-server` is always killed by its PID.
Only loopback targets (127.0.0.0/8, ::1, localhost) are accepted.

Output: JSON at `benchmarks/results/serving-<gpu-or-cpu>-<YYYY-MM-DD>.json` (`--out` overrides) with
the summary metrics, per-request TTFT / TPOT / e2e / lengths and ITL as a 101-point quantile grid; a
PNG next to it (`--plot` overrides) with the CDFs of TTFT, TPOT and ITL, one line per run (needs
matplotlib; skipped with a warning without it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import ipaddress
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator
from urllib.parse import urlsplit

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DEFAULT_URL = "http://127.0.0.1:8000"
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
RESERVED_SERVER_FLAGS = ("--host", "--port", "--listen-fd")
PERCENTILES = (50, 90, 99)
ITL_GRID = 101  # ITL is stored as its values at 0%, 1%, ..., 100%
MAX_ERRORS_KEPT = 20
WARMUP_PROMPT_LEN = 16
WARMUP_MAX_TOKENS = 4


# ------------------------------------------------------------------------------------------- arguments


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse the benchmark's own flags; whatever follows `--` is kept as `server_args`."""
    ours, server_args = split_server_args(argv)
    p = build_parser()
    args = p.parse_args(ours)
    args.server_args = server_args
    validate_args(p, args)
    return args


def split_server_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        return list(argv), []
    i = argv.index("--")
    return list(argv[:i]), list(argv[i + 1 :])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python3 -m benchmarks.serving",
        description="Online serving benchmark against pagekeeper's HTTP server (TTFT, TPOT, ITL, e2e, tok/s). "
        "Engine flags for --start-server go after '--'.",
    )
    target = p.add_argument_group("target")
    target.add_argument("--url", default=None, help=f"running server to load (loopback only; default {DEFAULT_URL})")
    target.add_argument(
        "--start-server",
        action="store_true",
        help="start `python -m engine.server` on a free 127.0.0.1 port with the flags after '--'",
    )
    target.add_argument(
        "--server-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the started server's GET /health == 200 (default 600)",
    )
    target.add_argument("--server-log", default=None, help="log file of the started server (default: a temp file)")
    target.add_argument(
        "--api-key", default=os.environ.get("PAGEKEEPER_API_KEY"), help="Bearer key for /v1/* (env PAGEKEEPER_API_KEY)"
    )
    target.add_argument("--model-name", default=None, help="`model` of the requests (default: from GET /v1/models)")

    load = p.add_argument_group("arrivals")
    mode = load.add_mutually_exclusive_group()
    mode.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=None,
        metavar="R",
        help="Poisson arrivals at R requests/s ('inf': all at once); several rates run in turn",
    )
    mode.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        metavar="C",
        help="keep C requests in flight; several values run in turn",
    )
    load.add_argument("--num-prompts", type=int, default=200, help="requests per rate / concurrency (default 200)")
    load.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request (default 300)")
    load.add_argument(
        "--max-duration",
        type=float,
        default=1800.0,
        help="cap in seconds on the whole benchmark after start-up (default 1800)",
    )
    load.add_argument(
        "--warmup",
        type=int,
        default=1,
        help=f"untimed warm-up requests ({WARMUP_PROMPT_LEN} -> {WARMUP_MAX_TOKENS} tokens) first",
    )

    work = p.add_argument_group("workload")
    work.add_argument("--input-len", type=int, default=256, help="median prompt length in tokens (default 256)")
    work.add_argument("--output-len", type=int, default=128, help="median output length in tokens (default 128)")
    work.add_argument("--max-input-len", type=int, default=1024, help="cap on prompt length (default 1024)")
    work.add_argument("--max-output-len", type=int, default=1024, help="cap on output length (default 1024)")
    work.add_argument(
        "--len-sigma",
        type=float,
        default=0.8,
        help="sigma of log(length) of the lognormal lengths; 0 gives fixed lengths (default 0.8)",
    )
    work.add_argument("--vocab", type=int, default=1000, help="token ids are drawn below this (default 1000)")
    work.add_argument(
        "--min-token-id",
        type=int,
        default=10,
        help="token ids are drawn from this up (skips special tokens; default 10)",
    )
    work.add_argument("--seed", type=int, default=0)

    out = p.add_argument_group("output")
    out.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/serving-<gpu-or-cpu>-<date>.json)"
    )
    out.add_argument("--plot", default=None, help="PNG path (default: the JSON path with .png)")
    out.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    out.add_argument(
        "--plot-only",
        default=None,
        metavar="RESULT.json",
        help="only redraw the PNG of an existing result (to --plot or RESULT.png)",
    )
    out.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return p


def validate_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.plot_only:
        return
    if args.start_server and args.url:
        p.error("give either --start-server or --url, not both")
    if args.server_args and not args.start_server:
        p.error("flags after '--' are for the server that --start-server starts; add --start-server")
    reserved = [a for a in args.server_args if a.split("=", 1)[0] in RESERVED_SERVER_FLAGS]
    if reserved:
        p.error(f"{', '.join(reserved)}: the benchmark picks the server's address itself (127.0.0.1, a free port)")
    if args.request_rate is None and args.concurrency is None:
        p.error("give --request-rate R [R ...] or --concurrency C [C ...]")
    if args.request_rate is not None and any(not r > 0 for r in args.request_rate):
        p.error("--request-rate values must be > 0 (or inf)")
    if args.concurrency is not None and any(c < 1 for c in args.concurrency):
        p.error("--concurrency values must be >= 1")
    check_workload_args(p, args)
    if not args.start_server:
        args.url = (args.url or DEFAULT_URL).rstrip("/")
        try:
            check_loopback(args.url)
        except ValueError as e:
            p.error(str(e))


def check_workload_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    positive = ("num_prompts", "input_len", "output_len", "max_input_len", "max_output_len")
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("request_timeout", "max_duration", "server_timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.input_len > args.max_input_len or args.output_len > args.max_output_len:
        p.error("the medians --input-len / --output-len must not exceed their caps --max-input-len / --max-output-len")
    if args.len_sigma < 0:
        p.error("--len-sigma must be >= 0")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if not 0 <= args.min_token_id < args.vocab:
        p.error(f"need 0 <= --min-token-id ({args.min_token_id}) < --vocab ({args.vocab})")


def check_loopback(url: str) -> None:
    """Raise ValueError unless `url` is http(s) to this machine (127.0.0.0/8, ::1 or localhost)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url must look like {DEFAULT_URL}, got {url!r}")
    host = parts.hostname
    if host.lower() in LOOPBACK_NAMES:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"refusing to load {host!r}: this benchmark only targets servers on this machine "
            f"(127.0.0.1, ::1 or localhost); run it on the server's host"
        )


# ------------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class WorkItem:
    prompt_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    max_input_len: int
    max_output_len: int
    len_sigma: float
    vocab: int
    min_token_id: int
    seed: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Workload:
        return cls(**{k: getattr(args, k) for k in cls.__dataclass_fields__})


def lognormal_lengths(rng: random.Random, n: int, median: int, cap: int, sigma: float) -> list[int]:
    """`n` lengths, lognormal with the given median and log-sigma, rounded and clipped to [1, cap]."""
    mu = math.log(median)
    return [min(cap, max(1, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def build_items(w: Workload, run_index: int) -> list[WorkItem]:
    """The requests of one run: lengths shared by every run, token ids fresh per run."""
    len_rng = random.Random(f"{w.seed}-lengths")
    inputs = lognormal_lengths(len_rng, w.num_prompts, w.input_len, w.max_input_len, w.len_sigma)
    outputs = lognormal_lengths(len_rng, w.num_prompts, w.output_len, w.max_output_len, w.len_sigma)
    tok_rng = random.Random(f"{w.seed}-tokens-{run_index}")
    return [
        WorkItem([tok_rng.randrange(w.min_token_id, w.vocab) for _ in range(n_in)], n_out)
        for n_in, n_out in zip(inputs, outputs)
    ]


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the run's start) of a Poisson process at `rate`/s; the first at 0.

    The same unit-exponential gaps are used for every rate, scaled by 1/rate, so runs differ only
    in their rate.  An infinite rate sends everything at once.
    """
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}-arrivals")
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(1.0) / rate
    return offsets


# ------------------------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no server log)"


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log_path: Path) -> None:
    """Poll GET /health until 200; raise with the log's tail if the server exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the server exited with {proc.returncode} before it was healthy; log {log_path}:\n{log_tail(log_path)}"
            )
        try:
            if httpx.get(url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(
        f"the server was not healthy after {timeout:.0f}s (--server-timeout); log {log_path}:\n{log_tail(log_path)}"
    )


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM by PID (the server drains), then SIGKILL if it is still there after `grace` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(grace)


@dataclass
class StartedServer:
    url: str
    pid: int
    log_path: Path
    cmd: list[str]


def temp_log_path() -> Path:
    fd, name = tempfile.mkstemp(prefix="serving-bench-server-", suffix=".log")
    os.close(fd)
    return Path(name)


@contextlib.contextmanager
def started_server(server_args: list[str], timeout: float, log_path: str | None) -> Iterator[StartedServer]:
    """Run `python -m engine.server` on a free loopback port for the duration of the block."""
    port = free_port()
    cmd = [sys.executable, "-m", "engine.server", "--host", "127.0.0.1", "--port", str(port), *server_args]
    path = Path(log_path) if log_path else temp_log_path()
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1"}
    print(f"starting server: {' '.join(cmd)} (log {path})", flush=True)
    with open(path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT))
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        wait_healthy(url, proc, timeout, path)
        print(f"server pid {proc.pid} healthy on {url} after {time.monotonic() - t0:.1f}s", flush=True)
        yield StartedServer(url, proc.pid, path, cmd)
    finally:
        stop_process(proc)
        print(f"server pid {proc.pid} stopped (exit {proc.returncode})", flush=True)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def server_info(url: str, api_key: str | None) -> dict[str, Any]:
    """Model name and max_model_len (GET /v1/models) and version (GET /version) of the server."""
    try:
        r = httpx.get(url + "/v1/models", headers=auth_headers(api_key), timeout=10.0, trust_env=False)
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach the server at {url}: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise RuntimeError(f"GET {url}/v1/models answered {r.status_code}: {r.text[:300]}")
    card = r.json()["data"][0]
    info: dict[str, Any] = {"url": url, "model": card["id"], "max_model_len": card.get("max_model_len")}
    with contextlib.suppress(httpx.HTTPError, ValueError):
        v = httpx.get(url + "/version", timeout=5.0, trust_env=False)
        if v.status_code == 200:
            info["version"] = v.json().get("version")
    return info


def check_fits(w: Workload, max_model_len: int | None) -> None:
    if max_model_len and w.max_input_len + w.max_output_len > max_model_len:
        raise SystemExit(
            f"error: --max-input-len {w.max_input_len} + --max-output-len {w.max_output_len} exceeds the "
            f"server's max_model_len {max_model_len}; lower the caps (or raise --max-model-len)"
        )


# ------------------------------------------------------------------------------------------- client


@dataclass
class RequestRecord:
    """What one request did; times are seconds since the run's start (perf_counter based)."""

    index: int
    prompt_len: int
    max_tokens: int
    send: float | None = None
    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # every chunk with text or a finish, in order
    end: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    status: int | None = None
    ok: bool = False
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None or self.send is None else self.first_token - self.send

    @property
    def e2e(self) -> float | None:
        return None if self.end is None or self.send is None else self.end - self.send

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        """Gaps between consecutive chunks from the first token on."""
        if self.first_token is None:
            return []
        times = [t for t in self.chunk_times if t >= self.first_token]
        return [b - a for a, b in zip(times, times[1:])]


@dataclass
class Target:
    url: str
    model: str
    headers: dict[str, str]
    request_timeout: float


def completion_payload(model: str, item: WorkItem) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": item.prompt_ids,
        "max_tokens": item.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def parse_sse_line(line: str) -> Any:
    """The JSON of a `data:` line, the string "[DONE]", or None for anything else."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return data if data == "[DONE]" else json.loads(data)


def take_chunk(rec: RequestRecord, chunk: dict[str, Any], t: float) -> None:
    """Record one SSE chunk received at `t`: token times, first token, usage."""
    if "error" in chunk:
        rec.error = f"error event: {str(chunk['error'])[:300]}"
    usage = chunk.get("usage")
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        rec.prompt_tokens = usage.get("prompt_tokens")
    for _choice in chunk.get("choices") or []:
        # The server sends a chunk whenever tokens were generated, even when their text is still
        # empty (special tokens, half a UTF-8 character, random-weight models): a token is a token.
        rec.chunk_times.append(t)
        if rec.first_token is None:
            rec.first_token = t


async def read_stream(resp: httpx.Response, rec: RequestRecord, t0: float) -> None:
    done = False
    async for line in resp.aiter_lines():
        item = parse_sse_line(line)
        if item is None:
            continue
        if item == "[DONE]":
            done = True
            break
        take_chunk(rec, item, time.perf_counter() - t0)
    if rec.error is None and not done:
        rec.error = "stream ended without [DONE]"
    elif rec.error is None and rec.output_tokens < 1:
        rec.error = "no usage chunk with completion_tokens"
    rec.ok = rec.error is None


async def send_request(
    client: httpx.AsyncClient, target: Target, item: WorkItem, rec: RequestRecord, t0: float
) -> None:
    """POST one streaming completion and fill `rec`; never raises except for cancellation."""
    rec.send = time.perf_counter() - t0
    try:
        async with asyncio.timeout(target.request_timeout):
            async with client.stream(
                "POST",
                target.url + "/v1/completions",
                headers=target.headers,
                json=completion_payload(target.model, item),
            ) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    rec.error = f"HTTP {resp.status_code}: {body[:300]}"
                    return
                await read_stream(resp, rec, t0)
    except TimeoutError:
        rec.error = f"timed out after {target.request_timeout:g}s (--request-timeout)"
    except asyncio.CancelledError:
        rec.error = "cancelled: --max-duration reached"
        raise
    except Exception as e:  # noqa: BLE001 - any failure is this request's result, not the benchmark's end
        rec.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        rec.end = time.perf_counter() - t0
        rec.ok = rec.ok and rec.error is None


# ------------------------------------------------------------------------------------------- runs


@dataclass
class RunSpec:
    mode: str  # "rate" or "concurrency"
    value: float

    @property
    def label(self) -> str:
        if self.mode == "rate":
            return "rate inf" if math.isinf(self.value) else f"rate {self.value:g}/s"
        return f"concurrency {int(self.value)}"


def run_specs(args: argparse.Namespace) -> list[RunSpec]:
    if args.request_rate is not None:
        return [RunSpec("rate", float(r)) for r in args.request_rate]
    return [RunSpec("concurrency", float(c)) for c in args.concurrency]


SendFn = Callable[[int], Awaitable[None]]


async def drive_poisson(n: int, offsets: list[float], t0: float, send: SendFn) -> None:
    """Start request i at t0 + offsets[i]; wait for all of them."""
    async with asyncio.TaskGroup() as tg:
        for i in range(n):
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tg.create_task(send(i))


async def drive_concurrency(n: int, concurrency: int, send: SendFn) -> None:
    """`concurrency` workers, each sending the next request as soon as its previous one ends."""
    pending = iter(range(n))

    async def worker() -> None:
        for i in pending:
            await send(i)

    async with asyncio.TaskGroup() as tg:
        for _ in range(min(concurrency, n)):
            tg.create_task(worker())


def make_progress(total: int, label: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", disable=not enabled, mininterval=0.5, file=sys.stderr)


async def run_one(
    client: httpx.AsyncClient,
    target: Target,
    spec: RunSpec,
    items: list[WorkItem],
    seed: int,
    time_left: float,
    progress: bool,
) -> tuple[list[RequestRecord], float, bool]:
    """Run one rate / concurrency; returns the records, the run's duration and whether it was cut off."""
    records = [RequestRecord(i, len(it.prompt_ids), it.max_tokens) for i, it in enumerate(items)]
    bar = make_progress(len(items), spec.label, progress)
    t0 = time.perf_counter()

    async def send(i: int) -> None:
        try:
            await send_request(client, target, items[i], records[i], t0)
        finally:
            bar.update(1)

    cut = False
    try:
        async with asyncio.timeout(time_left):
            if spec.mode == "rate":
                await drive_poisson(len(items), arrival_offsets(len(items), spec.value, seed), t0, send)
            else:
                await drive_concurrency(len(items), int(spec.value), send)
    except TimeoutError:
        cut = True
    finally:
        bar.close()
    for rec in records:
        if rec.send is None:
            rec.error = "not sent: --max-duration reached"
    ends = [r.end for r in records if r.end is not None]
    return records, (max(ends) if ends else time.perf_counter() - t0), cut


async def warm_up(client: httpx.AsyncClient, target: Target, w: Workload, count: int) -> None:
    """A few short, untimed requests (lazy initialisation, compilation); stop with the server's answer on failure."""
    rng = random.Random(f"{w.seed}-warmup")
    for _ in range(count):
        n_in = min(WARMUP_PROMPT_LEN, w.max_input_len)
        item = WorkItem(
            [rng.randrange(w.min_token_id, w.vocab) for _ in range(n_in)], min(WARMUP_MAX_TOKENS, w.max_output_len)
        )
        rec = RequestRecord(-1, n_in, item.max_tokens)
        await send_request(client, target, item, rec, time.perf_counter())
        if not rec.ok:
            raise RuntimeError(f"warm-up request failed: {rec.error}")


async def run_all(target: Target, w: Workload, specs: list[RunSpec], args: argparse.Namespace) -> list[dict[str, Any]]:
    deadline = time.monotonic() + args.max_duration
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    runs = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        async with asyncio.timeout(args.max_duration):
            await warm_up(client, target, w, args.warmup)
        for k, spec in enumerate(specs):
            items = build_items(w, k)
            print(f"run {k + 1}/{len(specs)}: {spec.label}, {len(items)} requests", flush=True)
            left = deadline - time.monotonic()
            if left <= 0:
                records, duration, cut = skipped_records(items), 0.0, True
            else:
                records, duration, cut = await run_one(client, target, spec, items, w.seed, left, not args.no_progress)
            runs.append(run_result(spec, records, duration, cut))
    return runs


def skipped_records(items: list[WorkItem]) -> list[RequestRecord]:
    return [
        RequestRecord(i, len(it.prompt_ids), it.max_tokens, error="not sent: --max-duration reached")
        for i, it in enumerate(items)
    ]


# ------------------------------------------------------------------------------------------- metrics


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of an already sorted, non-empty list."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in milliseconds (None when there are no values)."""
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = sorted(v * 1000.0 for v in values_s)
    out: dict[str, float | None] = {"mean": round(sum(ms) / len(ms), 3)}
    out.update({f"p{q}": round(percentile(ms, q), 3) for q in PERCENTILES})
    return out


def quantile_grid_ms(values_s: list[float]) -> list[float]:
    if not values_s:
        return []
    ms = sorted(v * 1000.0 for v in values_s)
    return [round(percentile(ms, 100.0 * i / (ITL_GRID - 1)), 3) for i in range(ITL_GRID)]


def ms_or_none(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 3)


def error_summary(records: list[RequestRecord]) -> dict[str, Any]:
    bad = [r for r in records if not r.ok]
    counts = Counter((r.error or "unknown")[:120] for r in bad)
    return {
        "error_counts": dict(counts.most_common()),
        "errors": [{"index": r.index, "status": r.status, "error": r.error} for r in bad[:MAX_ERRORS_KEPT]],
    }


def run_result(spec: RunSpec, records: list[RequestRecord], duration: float, cut: bool) -> dict[str, Any]:
    """The JSON object of one run: summary metrics plus per-request arrays."""
    ok = [r for r in records if r.ok]
    sent = [r for r in records if r.send is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    dur = max(duration, 1e-9)
    itls = [g for r in ok for g in r.itls()]
    return {
        "label": spec.label,
        "mode": spec.mode,
        "request_rate": (("inf" if math.isinf(spec.value) else spec.value) if spec.mode == "rate" else None),
        "concurrency": int(spec.value) if spec.mode == "concurrency" else None,
        "num_prompts": len(records),
        "completed": len(ok),
        "failed": len(sent) - len(ok),
        "not_sent": len(records) - len(sent),
        "cut_by_max_duration": cut,
        "duration_s": round(duration, 4),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": round(len(ok) / dur, 4),
        "output_throughput": round(out_tokens / dur, 3),
        "total_token_throughput": round((in_tokens + out_tokens) / dur, 3),
        "output_len_mismatch": sum(1 for r in ok if r.output_tokens != r.max_tokens),
        "ttft_ms": summarize_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": summarize_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": summarize_ms(itls),
        "e2e_ms": summarize_ms([r.e2e for r in ok if r.e2e is not None]),
        "itl_quantiles_ms": quantile_grid_ms(itls),
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.ok else None for r in records],
        "ttfts_ms": [ms_or_none(r.ttft) if r.ok else None for r in records],
        "tpots_ms": [ms_or_none(r.tpot) for r in records],
        "e2es_ms": [ms_or_none(r.e2e) if r.ok else None for r in records],
        **error_summary(records),
    }


# ------------------------------------------------------------------------------------------- report


def fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def table_rows(runs: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    rows: list[tuple[str, list[str]]] = [
        ("completed / failed / not sent", [f"{r['completed']}/{r['failed']}/{r['not_sent']}" for r in runs]),
        ("duration s", [fmt(r["duration_s"], 2) for r in runs]),
        ("requests/s", [fmt(r["request_throughput"], 2) for r in runs]),
        ("output tok/s", [fmt(r["output_throughput"]) for r in runs]),
        ("total tok/s", [fmt(r["total_token_throughput"]) for r in runs]),
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "e2e")):
        for stat in ("mean", *(f"p{q}" for q in PERCENTILES)):
            if stat == "mean" and key not in ("ttft_ms", "tpot_ms"):
                continue
            rows.append((f"{name} {stat} ms", [fmt(r[key][stat], 2) for r in runs]))
    return rows


def print_table(result: dict[str, Any]) -> None:
    runs = result["runs"]
    w = result["workload"]
    print()
    print(
        f"serving benchmark: {result['server']['model']} on {result['gpu']}, {w['num_prompts']} requests per run, "
        f"input median/cap {w['input_len']}/{w['max_input_len']}, "
        f"output median/cap {w['output_len']}/{w['max_output_len']}"
    )
    labels = [r["label"] for r in runs]
    width = max(12, *(len(s) for s in labels)) + 2
    print(f"{'':<30}" + "".join(f"{s:>{width}}" for s in labels))
    print("-" * (30 + width * len(labels)))
    for name, cells in table_rows(runs):
        print(f"{name:<30}" + "".join(f"{c:>{width}}" for c in cells))
    for r in runs:
        if r["error_counts"]:
            print(f"{r['label']}: errors {r['error_counts']}")
        if r["output_len_mismatch"]:
            print(
                f"{r['label']}: {r['output_len_mismatch']} request(s) returned another number of tokens than max_tokens"
            )


def device_label(server_args: list[str]) -> str:
    """'cpu' when the server was told --device cpu or there is no GPU, else the GPU's name as a slug."""
    for i, a in enumerate(server_args):
        value = (
            a.split("=", 1)[1]
            if a.startswith("--device=")
            else (server_args[i + 1] if a == "--device" and i + 1 < len(server_args) else None)
        )
        if value == "cpu":
            return "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            return slug(torch.cuda.get_device_name(0))
    except Exception:  # noqa: BLE001 - a label, not worth failing the benchmark over
        pass
    return "cpu"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "", name.strip().lower().replace(" ", "-")) or "unknown"


def default_out_path(gpu: str, date: str) -> Path:
    return RESULTS_DIR / f"serving-{gpu}-{date}.json"


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------------- plot


def cdf_series(run: dict[str, Any], metric: str) -> list[float]:
    """Sorted values of `metric` (ttft / tpot / itl) of one run, in ms."""
    if metric == "itl":
        return list(run.get("itl_quantiles_ms") or [])
    return sorted(v for v in run.get(f"{metric}s_ms") or [] if v is not None)


def plot_result(result: dict[str, Any], png: Path) -> bool:
    """CDFs of TTFT, TPOT and ITL, one line per run; False (with a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "warning: matplotlib is not installed; no plot (pip install matplotlib, then --plot-only)",
            file=sys.stderr,
            flush=True,
        )
        return False
    metrics = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, (key, name) in zip(axes[0], metrics):
        draw_cdfs(ax, result["runs"], key, name)
    server = result.get("server") or {}
    fig.suptitle(
        f"pagekeeper serving: {server.get('model', '?')} on {result.get('gpu', '?')}, {result.get('date', '')}"
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def draw_cdfs(ax: Any, runs: list[dict[str, Any]], key: str, name: str) -> None:
    all_values = []
    for run in runs:
        xs = cdf_series(run, key)
        if not xs:
            continue
        all_values += xs
        if key == "itl":  # a quantile grid: the i-th of n values is the (i / (n - 1))-quantile
            ys = [i / (len(xs) - 1 or 1) for i in range(len(xs))]
        else:  # the empirical CDF of the requests
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=run["label"])
    positive = [v for v in all_values if v > 0]
    if positive and max(positive) / min(positive) > 20:
        ax.set_xscale("log")
    ax.set_xlabel(f"{name} (ms)")
    ax.set_ylabel("fraction of " + ("gaps" if key == "itl" else "requests"))
    ax.set_title(f"{name} CDF")
    ax.grid(True, alpha=0.3)
    if all_values:
        ax.legend(fontsize=8)


def plot_only(json_path: str, png: str | None) -> int:
    path = Path(json_path)
    result = json.loads(path.read_text(encoding="utf-8"))
    out = Path(png) if png else path.with_suffix(".png")
    if plot_result(result, out):
        print(f"wrote {out}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------- main


def reproduce_command(argv: list[str]) -> list[str]:
    return ["python3", "-m", "benchmarks.serving", *argv]


def build_result(
    args: argparse.Namespace, argv: list[str], server: dict[str, Any], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "gpu": device_label(args.server_args),
        "date": _dt.date.today().isoformat(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": reproduce_command(argv),
        "server_args": list(args.server_args),
        "server": server,
        "workload": {
            **Workload.from_args(args).__dict__,
            "arrival": "poisson" if args.request_rate is not None else "concurrency",
            "request_timeout_s": args.request_timeout,
            "max_duration_s": args.max_duration,
            "warmup_requests": args.warmup,
            "endpoint": "/v1/completions (token ids, temperature 0, ignore_eos, stream, include_usage)",
        },
        "runs": runs,
    }


def benchmark(
    args: argparse.Namespace, url: str, server_extra: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    info = {**server_info(url, args.api_key), **server_extra}
    w = Workload.from_args(args)
    check_fits(w, info.get("max_model_len"))
    target = Target(url, args.model_name or info["model"], auth_headers(args.api_key), args.request_timeout)
    runs = asyncio.run(run_all(target, w, run_specs(args), args))
    return info, runs


def run_against_target(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    if not args.start_server:
        return benchmark(args, args.url, {"started_by_benchmark": False})
    with started_server(args.server_args, args.server_timeout, args.server_log) as srv:
        extra = {"started_by_benchmark": True, "pid": srv.pid, "log": str(srv.log_path), "cmd": srv.cmd[1:]}
        return benchmark(args, srv.url, extra)


def raise_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so that `finally` blocks (killing the server) run."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if args.plot_only:
        return plot_only(args.plot_only, args.plot)
    raise_on_sigterm()
    try:
        server, runs = run_against_target(args)
    except (RuntimeError, TimeoutError, httpx.HTTPError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    result = build_result(args, raw, server, runs)
    out = Path(args.out) if args.out else default_out_path(result["gpu"], result["date"])
    write_json(result, out)
    print_table(result)
    print(f"\nwrote {out}", flush=True)
    if not args.no_plot:
        png = Path(args.plot) if args.plot else out.with_suffix(".png")
        if plot_result(result, png):
            print(f"wrote {png}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
