"""How long service stops when the supervisor acts: cold start, restart under load, kill -9, the stuck-cache cure.

    python -m benchmarks.restart --shape 8b                          # one GPU (issue 35, must-show 1-3)
    python -m benchmarks.restart --shape 70b --tp 4 --skip real,recycle   # the production line's shape, 4 GPUs
    python -m benchmarks.restart --quick                             # CPU smoke run on the embedded model

Everything goes through `opsctl` as an operator runs it: a TOML file, `opsctl start`, `opsctl restart`, kill -9 of
the engine's process, and a KV leak injected through the engine's test hook (`/debug/leak-kv`) that the policy
must notice and cure in place.  Load: `--clients` HTTP clients (a quarter each: streaming or not, kept-alive
connection or a new one per request), completions of `--max-tokens` tokens (ignore_eos), every request recorded
with its start, end and outcome; "ok" only for a complete answer.  Per scenario: requests failed, the longest gap
without a completed request, the latency p50/p99/max of requests that started during it.

Scenarios, in order: the first start on a fresh host (Triton and probe caches empty), then `cold_start` (caches
warm, page cache warm): `opsctl start` to the first completion, with the engine's phase table; `restart` under
load; `kill9` under load (first completion after the kill, requests lost); `recycle` (a leak that starves the load
is cured in place: the decision, its seconds, the gap) and `recycle_idle` (a leak with no traffic); then `real`:
the same shape as a safetensors checkpoint written to local disk, started with the page cache warm and, when the
host lets us drop it, cold.  Results: `<out>/restart-<gpu>-<date>.json` (written after every scenario), with the
command line, the GPU, the CPU model and the date.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.cpu_pair_contention import cpu_model

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "bench"

# The production line this project was designed from (issue 36): 70B shape at TP=4.
PRODUCTION_FLAGS = {
    "gpu_memory_utilization": 0.88,
    "max_model_len": 32768,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 24576,
    "block_size": 16,
    "swap_space": 8,
    "enable_chunked_prefill": True,
}
FAST_POLICY = {
    "poll_interval": 0.5,
    "probe_timeout": 2.0,
    "cooldown_seconds": 3.0,
    "events_to_act": 2,
    "event_window": 20.0,  # a leak within this of the last cure escalates to a restart (opsctl/policy.py)
    "pressure_wait_seconds": 0.5,
    "ready_timeout": 600.0,
    "drain_timeout": 60.0,
    "max_restarts": 20,
    "metrics_port": 0,
    "launcher": "process",
}


# -- the load ---------------------------------------------------------------------------------------------------


@dataclass
class Record:
    kind: str
    start: float
    end: float
    ok: bool
    detail: str = ""


@dataclass
class Load:
    url: str
    clients: int
    max_tokens: int
    records: list[Record] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    KINDS = ("plain-keepalive", "plain-new", "stream-keepalive", "stream-new")

    def start(self) -> Load:
        for i in range(self.clients):
            kind = self.KINDS[i % len(self.KINDS)]
            t = threading.Thread(target=self._client, args=(kind, i), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> list[Record]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        return self.records

    def _client(self, kind: str, i: int) -> None:
        stream, keep = kind.startswith("stream"), kind.endswith("keepalive")
        body = {
            "model": MODEL,
            "prompt": f"Beautiful is better than ugly. Client {i} says",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
        }
        client = httpx.Client(base_url=self.url, timeout=120) if keep else None
        while not self._stop.is_set():
            start = time.monotonic()
            ok, detail = False, ""
            try:
                c = client or httpx.Client(base_url=self.url, timeout=120, headers={"connection": "close"})
                try:
                    ok, detail = _one(c, body, stream, self.max_tokens)
                finally:
                    if client is None:
                        c.close()
            except httpx.HTTPError as e:
                detail = f"{type(e).__name__}: {e}"
            with self._lock:
                self.records.append(Record(kind, start, time.monotonic(), ok, detail[:200]))
            if not ok:
                time.sleep(0.05)
        if client is not None:
            client.close()


def _one(c: httpx.Client, body: dict[str, Any], stream: bool, want: int) -> tuple[bool, str]:
    if not stream:
        r = c.post("/v1/completions", json=body)
        if r.status_code != 200:
            return False, f"http {r.status_code}: {r.text[:120]}"
        got = r.json()["usage"]["completion_tokens"]
        return got == want, f"{got} tokens"
    chunks, done = 0, False
    with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return False, f"http {r.status_code}"
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return False, f"error event: {event['error']}"
                chunks += 1
    return done and chunks > 0, f"{chunks} chunks, done={done}"


def window_stats(records: list[Record], t0: float, t1: float) -> dict[str, Any]:
    """Failures, the longest gap between completions and latencies, for requests that overlap [t0, t1]."""
    inside = [r for r in records if r.end >= t0 and r.start <= t1]
    ends = sorted(r.end for r in records if r.ok and t0 <= r.end <= t1)
    marks = [t0, *ends, t1]
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    started = sorted(r.end - r.start for r in inside if r.ok and r.start >= t0)
    failed = [r for r in inside if not r.ok]
    return {
        "requests": len(inside),
        "failed": len(failed),
        "failures": [f"{r.kind}: {r.detail}" for r in failed[:10]],
        "longest_gap_s": round(max(gaps), 3) if gaps else None,
        "completions": len(ends),
        "latency_p50_s": round(_pct(started, 50), 3) if started else None,
        "latency_p99_s": round(_pct(started, 99), 3) if started else None,
        "latency_max_s": round(started[-1], 3) if started else None,
    }


def _pct(values: list[float], p: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, int(p) - 1))]


# -- the deployment ---------------------------------------------------------------------------------------------


class Deployment:
    def __init__(self, root: Path, engine: dict[str, Any], supervisor: dict[str, Any], port: int) -> None:
        self.root, self.port = root, port
        self.runtime = root / "run"
        self.config = root / "pagekeeper.toml"
        lines = ["[engine]", *(f"{k} = {_toml(v)}" for k, v in {"port": port, **engine}.items())]
        lines += ["", "[supervisor]", *(f"{k} = {_toml(v)}" for k, v in supervisor.items())]
        self.config.write_text("\n".join(lines) + "\n")
        self.url = f"http://127.0.0.1:{port}"

    def opsctl(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "opsctl.cli", "--config", str(self.config), "--runtime-dir", str(self.runtime)]
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
        return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)

    def status(self) -> dict[str, Any]:
        r = self.opsctl("status", "--json", timeout=60)
        try:
            return dict(json.loads(r.stdout))
        except ValueError:
            return {}

    def events(self, log: str, name: str) -> list[dict[str, Any]]:
        path = self.runtime / log
        out = []
        for line in path.read_text(errors="replace").splitlines() if path.exists() else ():
            if line.startswith("{") and f'"{name}"' in line:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == name:
                    out.append(event)
        return out

    def stop(self) -> None:
        self.opsctl("stop", timeout=300)
        mine = str(self.runtime)
        import psutil

        for proc in psutil.process_iter(["cmdline"]):
            if proc.pid != os.getpid() and any(mine in a for a in proc.info["cmdline"] or ()):
                try:
                    proc.kill()
                except psutil.Error:
                    pass


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v) if isinstance(v, str) else str(v)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_completion(url: str, since: float, timeout: float) -> float:
    """Seconds from `since` to the first complete answer (polled every 50 ms)."""
    body = {"model": MODEL, "prompt": "Beautiful is", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    deadline = since + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            if r.status_code == 200:
                return time.monotonic() - since
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"no completion within {timeout:.0f} s")


def engine_pid(d: Deployment) -> int:
    pid = d.status().get("engine", {}).get("pid")
    if not pid:
        raise RuntimeError(f"no engine pid in status: {d.status()}")
    return int(pid)


def wait_deferred_done(d: Deployment, count: int, timeout: float) -> float | None:
    """Wait until `count` engines have logged deferred_work_done (graphs captured); its seconds, or None."""
    ready = d.events("engine.log", "engine_ready")
    if ready and not ready[-1].get("deferred"):
        return 0.0  # nothing was deferred (the CPU)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = d.events("engine.log", "deferred_work_done")
        if len(done) >= count:
            return float(done[-1].get("seconds", 0.0))
        time.sleep(0.5)
    return None


def num_gpu_blocks(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info"):
            return int(line.split('num_gpu_blocks="')[1].split('"')[0])
    raise RuntimeError("no vllm:cache_config_info in /metrics")


# -- scenarios --------------------------------------------------------------------------------------------------


def wait_spare(d: Deployment, timeout: float = 120) -> float | None:
    """Seconds until the supervisor's spare engine stands by (None: this deployment keeps none, or it did not)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        spare = d.status().get("supervisor", {}).get("spare_engine")
        if not spare:
            return None
        if spare.get("state") == "standby":
            return round(time.monotonic() - started, 3)
        time.sleep(0.5)
    return None


def startup_timeline(d: Deployment) -> dict[str, float] | None:
    serving = d.events("engine.log", "serving")
    return serving[-1].get("startup") if serving else None


def first_steps(d: Deployment) -> dict[str, Any] | None:
    """The serving engine's `first_steps` line (engine/core/first_steps.py): what the requests that waited met next."""
    events = d.events("engine.log", "first_steps")
    return {k: v for k, v in events[-1].items() if k not in ("event", "level", "timestamp")} if events else None


def scenario_start(d: Deployment, timeout: float) -> dict[str, Any]:
    t0 = time.monotonic()
    r = d.opsctl("start", timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"opsctl start failed ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}")
    started = time.monotonic() - t0
    first = first_completion(d.url, t0, timeout)
    ready = d.events("engine.log", "engine_ready")
    kept = d.events("engine.log", "weights_kept")
    return {
        "opsctl_start_s": round(started, 3),
        "first_completion_s": round(first, 3),
        "engine_phases": ready[-1].get("phases") if ready else None,
        "startup_timeline": startup_timeline(d),
        "engine_load_s": ready[-1].get("load_seconds") if ready else None,
        "weights_from": ready[-1].get("weights_from") if ready else None,
        "keeper_load_s": kept[-1].get("seconds") if kept else None,
    }


def scenario_restart(d: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    spare_ready_s = wait_spare(d)
    load = Load(d.url, args.clients, args.max_tokens).start()
    time.sleep(args.settle)
    old = engine_pid(d)
    t0 = time.monotonic()
    r = d.opsctl("restart", timeout=600)
    t1 = time.monotonic()
    first = first_completion(d.url, t1, 300)
    time.sleep(args.settle)
    records = load.stop()
    stats = window_stats(records, t0, t1 + first + args.settle)
    return {
        "opsctl_restart_rc": r.returncode,
        "opsctl_restart_s": round(t1 - t0, 3),
        "old_pid": old,
        "new_pid": engine_pid(d),
        "spare_standing_by_after_s": spare_ready_s,
        **new_engine(d),
        **stats,
    }


def scenario_kill9(d: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    spare_ready_s = wait_spare(d)
    load = Load(d.url, args.clients, args.max_tokens).start()
    time.sleep(args.settle)
    pid = engine_pid(d)
    t0 = time.monotonic()
    os.killpg(pid, signal.SIGKILL)  # the engine and, at TP > 1, its ranks
    first = first_completion(d.url, t0, 600)
    time.sleep(args.settle)
    records = load.stop()
    in_flight = [r for r in records if r.start < t0 < r.end]
    after = sorted(r.end - t0 for r in records if r.ok and r.start >= t0)
    stats = window_stats(records, t0, t0 + first + args.settle)
    return {
        "first_completion_s": round(first, 3),
        "first_load_completion_s": round(after[0], 3) if after else None,
        "in_flight_at_kill": len(in_flight),
        "lost": sum(1 for r in in_flight if not r.ok),
        "spare_standing_by_after_s": spare_ready_s,
        **new_engine(d),
        **stats,
    }


def scenario_rank_kill(d: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    """kill -9 of one tensor-parallel rank (not rank 0) under load: the engine core's group ends with one line and
    the front resumes what was in flight on a new core (engine/loop/), with no supervisor restart."""
    import psutil

    load = Load(d.url, args.clients, args.max_tokens).start()
    time.sleep(args.settle)
    front = engine_pid(d)
    under = psutil.Process(front).children(recursive=True)
    ranks = [p for p in under if "engine.distributed.worker" in " ".join(p.cmdline())]
    if not ranks:
        load.stop()
        return {"skipped": "no tensor-parallel worker under the engine"}
    victim = ranks[-1]
    restarts_before = d.status()["restarts"]["total"]
    t0 = time.monotonic()
    victim.kill()
    first = first_completion(d.url, t0, 600)
    time.sleep(args.settle)
    records = load.stop()
    in_flight = [r for r in records if r.start < t0 < r.end]
    stats = window_stats(records, t0, t0 + first + args.settle)
    failed_lines = d.events("engine.log", "tp_rank_failed")
    return {
        "killed_rank_pid": victim.pid,
        "first_completion_s": round(first, 3),
        "in_flight_at_kill": len(in_flight),
        "lost": sum(1 for r in in_flight if not r.ok),
        "same_front": engine_pid(d) == front,
        "supervisor_restarts": d.status()["restarts"]["total"] - restarts_before,
        "rank_failed": {k: failed_lines[-1].get(k) for k in ("rank", "reason")} if failed_lines else None,
        **new_engine(d),
        **stats,
    }


def new_engine(d: Deployment) -> dict[str, Any]:
    """What the engine that took over reported: its start-up phases and timeline, where its weights came from, and
    its first steps."""
    ready = d.events("engine.log", "engine_ready")
    return {
        "new_engine_phases": ready[-1].get("phases") if ready else None,
        "new_engine_timeline": startup_timeline(d),
        "weights_from": ready[-1].get("weights_from") if ready else None,
        "new_engine_first_steps": first_steps(d),
    }


def scenario_recycle(d: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    """A leak that leaves room for a few requests: the rest wait, the policy sees pressure and recycles."""
    load = Load(d.url, args.clients, args.max_tokens).start()
    time.sleep(args.settle)
    blocks = num_gpu_blocks(d.url)
    leave = 4 * -(-(args.max_tokens + 24) // 16)  # room for four requests: the others wait
    leak = blocks
    pid = engine_pid(d)
    before = len(d.events("supervisor.log", "engine_recycled"))
    t0 = time.monotonic()
    httpx.post(d.url + f"/debug/leak-kv?blocks={leak}&leave={leave}", timeout=10).raise_for_status()
    cured = None
    while time.monotonic() - t0 < 120:
        events = d.events("supervisor.log", "engine_recycled")
        if len(events) > before:
            cured = events[-1]
            break
        time.sleep(0.2)
    t1 = time.monotonic()
    time.sleep(args.settle)
    records = load.stop()
    decisions = [e for e in d.events("supervisor.log", "decision") if e.get("action") in ("recycle", "drain_restart")]
    return {
        "leak_left_free_blocks": leave,
        "num_gpu_blocks": blocks,
        "cured": cured is not None,
        "cured_after_s": round(t1 - t0, 3) if cured else None,
        "decision": {k: decisions[-1].get(k) for k in ("action", "reason", "evidence")} if decisions else None,
        "recycle": {k: cured.get(k) for k in ("reason", "requeued", "reclaimed_blocks", "seconds")} if cured else None,
        "same_engine_pid": engine_pid(d) == pid,
        **window_stats(records, t0, t1 + args.settle),
    }


def scenario_recycle_idle(d: Deployment) -> dict[str, Any]:
    blocks = num_gpu_blocks(d.url)
    before = len(d.events("supervisor.log", "engine_recycled"))
    t0 = time.monotonic()
    httpx.post(d.url + f"/debug/leak-kv?blocks={blocks // 2}", timeout=10).raise_for_status()
    while time.monotonic() - t0 < 120:
        events = d.events("supervisor.log", "engine_recycled")
        if len(events) > before:
            return {"cured_after_s": round(time.monotonic() - t0, 3), "reason": events[-1].get("reason")}
        time.sleep(0.2)
    return {"cured_after_s": None}


def write_real_checkpoint(model_dir: str, dest: Path) -> float:
    """The shape's config with random bf16 weights as sharded safetensors on local disk; seconds it took."""
    import torch
    from safetensors.torch import save_file

    from engine.config import EngineConfig
    from engine.model.loader import inspect_model

    started = time.monotonic()
    dest.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(model_dir):
        shutil.copy(Path(model_dir) / name, dest / name)
    info = inspect_model(EngineConfig(model=str(dest), device="cpu", load_format="dummy"))
    shapes = _hf_tensor_shapes(info.hf_config)
    gen = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    size, index, weight_map = 0, 0, {}

    def flush() -> None:
        nonlocal shard, size, index
        if not shard:
            return
        fname = f"model-{index:05d}.safetensors"
        save_file(shard, str(dest / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        shard, size, index = {}, 0, index + 1

    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16, device=gen.device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        shard[name] = t.cpu()
        size += t.numel() * 2
        if size >= 4 << 30:
            flush()
    flush()
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    os.sync()
    return time.monotonic() - started


def _hf_tensor_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """A Llama checkpoint's tensor names and shapes, as transformers writes them."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    d = h // heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (heads * d, h),
                p + "self_attn.k_proj.weight": (kv * d, h),
                p + "self_attn.v_proj.weight": (kv * d, h),
                p + "self_attn.o_proj.weight": (h, heads * d),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    out["model.norm.weight"] = (h,)
    if not getattr(cfg, "tie_word_embeddings", False):
        out["lm_head.weight"] = (v, h)
    return out


def drop_page_cache() -> str | None:
    """Drop the page cache (root on Linux); None when done, else why not."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return None
    except OSError as e:
        return str(e)


def warm_page_cache(path: Path) -> float:
    started = time.monotonic()
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    return time.monotonic() - started


# -- the run ----------------------------------------------------------------------------------------------------


def model_dir_for(shape: str, quick: bool) -> str:
    from benchmarks.memory import model_dir

    path = model_dir(quick)
    if quick:
        return path
    if shape == "70b":
        from benchmarks.tensor_parallel import LLAMA31_70B

        cfg = json.loads((Path(path) / "config.json").read_text())
        keep = {k: cfg[k] for k in ("bos_token_id", "eos_token_id")}
        (Path(path) / "config.json").write_text(json.dumps({**LLAMA31_70B, **keep}))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.restart")
    p.add_argument("--shape", choices=("8b", "70b"), default="8b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="CPU smoke run on the embedded model")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--settle", type=float, default=5.0, help="seconds of load before and after each action")
    p.add_argument(
        "--skip", default="", help="comma-separated scenarios to skip: first,restart,kill9,rank_kill,recycle,real"
    )
    p.add_argument("--keep-weights", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--logs", default=None, help="also write the engine and supervisor logs here, as one .tar.gz")
    args = p.parse_args(argv)
    # `timeout` (or a device's limit) sends SIGTERM: leave through the finally blocks, which stop the deployments
    # (their processes run in sessions of their own and would keep the GPUs) and archive the logs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    skip = {s for s in args.skip.split(",") if s}
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.quick else "cpu"
    tag = gpu.lower().replace("nvidia ", "").split()[0] if gpu != "cpu" else "cpu"
    if args.tp > 1:
        tag += f"x{args.tp}"
    out_path = Path(args.out) / f"restart-{tag}-{dt.date.today().isoformat()}.json"
    result: dict[str, Any] = {
        "benchmark": "restart",
        "command": "python -m benchmarks.restart " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": dt.date.today().isoformat(),
        "gpu": gpu,
        "gpus": args.tp,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "shape": "embedded" if args.quick else args.shape,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "versions": {"torch": torch.__version__},
    }

    def save() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")

    path = model_dir_for(args.shape, args.quick)
    engine: dict[str, Any] = {
        "model": path,
        "served_model_name": MODEL,
        "enable_debug_hooks": True,  # /debug/leak-kv: the stuck-cache scenario's fault
        "disable_log_requests": True,
    }
    if args.quick:
        engine.update(device="cpu", max_num_seqs=8)
    else:
        engine["load_format"] = "dummy"
        if args.shape == "70b":
            engine.update(PRODUCTION_FLAGS)
        if args.tp > 1:
            engine["tensor_parallel_size"] = args.tp
    supervisor = {**FAST_POLICY, "keep_weights": "on" if args.quick else args.keep_weights}
    root = Path(tempfile.mkdtemp(prefix="pagekeeper-restart-"))
    print(f"restart benchmark: {gpu}, shape {result['shape']}, tp {args.tp}, dir {root}", flush=True)

    def deploy(name: str, eng: dict[str, Any]) -> Deployment:
        (root / name).mkdir()
        return Deployment(root / name, eng, supervisor, _free_port())

    d = deploy("dummy", engine)
    try:
        return _scenarios(args, skip, result, save, root, d, deploy, engine, path)
    finally:
        if args.logs:
            archive_logs(root, args.logs, tag)
        shutil.rmtree(root, ignore_errors=True)


def _scenarios(args, skip, result, save, root, d, deploy, engine, path) -> int:  # type: ignore[no-untyped-def]
    try:
        if "first" not in skip:
            print("first start (Triton and probe caches empty on a fresh host)...", flush=True)
            result["first_start"] = scenario_start(d, 900)
            result["first_start"]["deferred_work_s"] = wait_deferred_done(d, 1, 600)
            d.opsctl("stop", timeout=300)
            save()
        print("cold start (caches warm)...", flush=True)
        result["cold_start"] = scenario_start(d, 900)
        result["cold_start_s"] = result["cold_start"]["first_completion_s"]
        result["cold_start"]["deferred_work_s"] = wait_deferred_done(d, 1 if "first" in skip else 2, 600)
        save()
        if "restart" not in skip:
            print("restart under load...", flush=True)
            result["restart"] = scenario_restart(d, args)
            key = "tp4_" if args.tp == 4 else ""
            result[f"{key}restart_failed"] = result["restart"]["failed"]
            result[f"{key}restart_longest_gap_s"] = result["restart"]["longest_gap_s"]
            save()
        if "kill9" not in skip:
            print("kill -9 of the engine under load...", flush=True)
            result["kill9"] = scenario_kill9(d, args)
            key = "tp4_" if args.tp == 4 else ""
            result[f"{key}kill9_first_completion_s"] = result["kill9"]["first_completion_s"]
            save()
        if "rank_kill" not in skip and args.tp > 1:
            print("kill -9 of one tensor-parallel rank under load...", flush=True)
            time.sleep(FAST_POLICY["cooldown_seconds"] + 1)
            result["rank_kill"] = scenario_rank_kill(d, args)
            result["rank_kill_failed"] = result["rank_kill"].get("failed")
            save()
        if "recycle" not in skip:
            print("stuck cache: a KV leak under load, cured in place...", flush=True)
            time.sleep(FAST_POLICY["cooldown_seconds"] + 1)
            result["recycle"] = scenario_recycle(d, args)
            result["recycle_longest_gap_s"] = result["recycle"]["longest_gap_s"]
            save()
            print("stuck cache with no traffic...", flush=True)
            time.sleep(FAST_POLICY["event_window"] + 1)  # a new leak, not the last one's cure failing
            result["recycle_idle"] = scenario_recycle_idle(d)
            save()
    finally:
        d.stop()
    if "real" not in skip and not args.quick:
        print("a real safetensors checkpoint on local disk...", flush=True)
        real_dir = root / "checkpoint"
        result["real"] = {"write_s": round(write_real_checkpoint(path, real_dir), 1)}
        save()
        real = {**engine, "model": str(real_dir), "load_format": "auto"}
        r = deploy("real", real)
        try:
            result["real"]["first"] = scenario_start(r, 900)  # this checkpoint's probes, measured once
            r.opsctl("stop", timeout=300)
            result["real"]["page_cache_read_s"] = round(warm_page_cache(real_dir), 2)
            result["real"]["warm"] = scenario_start(r, 900)
            result["real"]["cold_start_s"] = result["real"]["warm"]["first_completion_s"]
            r.opsctl("stop", timeout=300)
            why = drop_page_cache()
            if why is None:
                result["real"]["cold_page_cache"] = scenario_start(r, 900)
            else:
                result["real"]["cold_page_cache"] = f"not measured: cannot drop the page cache here ({why})"
        finally:
            r.stop()
        save()
    save()
    print(json.dumps(result))
    return 0


def archive_logs(root: Path, dest: str, tag: str) -> None:
    import tarfile

    Path(dest).mkdir(parents=True, exist_ok=True)
    with tarfile.open(Path(dest) / f"restart-logs-{tag}.tar.gz", "w:gz") as tar:
        for log in sorted(root.glob("*/run/*.log")):
            tar.add(log, arcname=str(log.relative_to(root)))


if __name__ == "__main__":
    sys.exit(main())
