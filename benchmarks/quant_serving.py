"""Issue 39's serving path (must-show 4): `opsctl start` with quantization "fp8" and "awq" serves a completion, and
the memory plan `opsctl doctor` shows has the weight bytes halved / quartered against bf16.

    python -m benchmarks.quant_serving --out DIR           # one GPU: the Llama-3-8B shape, random weights
    python -m benchmarks.quant_serving --quick --out DIR   # the CPU dry run: the embedded model, its AWQ checkpoint

Every configuration goes through `opsctl` as an operator runs it: a TOML file (`[engine]` with the model, the
dtype and `quantization`; `[supervisor]` with the process launcher, no kept weights, no spare engine), a private
runtime dir and a free port; `opsctl start`, one completion over HTTP, `opsctl doctor --json` (its `weights`
line: bytes per storage dtype, read from the checkpoint's files), `opsctl stop`.  On the GPU the checkpoints are
benchmarks/quantization.py's: the 8B shape with `load_format = "dummy"` (bf16, and fp8 quantized at load), and
the same directory with AutoAWQ's `quantization_config` for AWQ (float16).  The CPU dry run serves the embedded
model in float32 (bf16 matmuls are slow on CPUs) and a real AWQ checkpoint of it written by the quantizer.

Writes `<out>/quant-serving-<gpu>-<date>.json` after every configuration: per configuration the completion, the
seconds of each step, doctor's weights line and the figures read from it, and the engine's own weights per dtype
(its `engine_ready` log event); then `weight_ratio_fp8` and `weight_ratio_awq` (all weights over bf16's, doctor's
figures; `engine_weight_ratio_*` the same from the engines' exact counts) and `linear_weight_ratio_*` (the decoder's
linear layers only: the embedding, LM head and norms stay 16-bit, so the whole model cannot reach 1/2 or 1/4; the
8B's are 2.1 GB of its 16.1 GB).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.restart import FAST_POLICY, Deployment, _free_port

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "bench"
# (name, [engine] keys, checkpoint: "base" or "awq")
CONFIGS: list[tuple[str, dict[str, Any], str]] = [
    ("bf16", {"dtype": "bfloat16"}, "base"),
    ("fp8", {"dtype": "bfloat16", "quantization": "fp8"}, "base"),
    ("awq", {"dtype": "float16", "quantization": "awq"}, "awq"),
]
_SIZE = re.compile(r"([A-Za-z0-9_]+) ([0-9.]+) (GiB|MiB)")


def doctor_weights(detail: str) -> dict[str, Any]:
    """doctor's `weights` line as numbers (from its rounded GiB / MiB figures): bytes per storage dtype, the total
    it shows (after "=", else the one dtype's), and the unquantized size it names, if any.  E.g. "int32 3.50 GiB,
    float16 1.96 GiB = 5.46 GiB: awq; 14.96 GiB unquantized in float16 (2.74x)"."""
    unit = {"GiB": 2**30, "MiB": 2**20}
    head, _, tail = detail.partition(" = ")
    by_dtype = {name: int(float(n) * unit[u]) for name, n, u in _SIZE.findall(head.split(" (")[0])}
    total = re.match(r"([0-9.]+) (GiB|MiB)", tail)
    out: dict[str, Any] = {
        "by_dtype": by_dtype,
        "bytes": int(float(total.group(1)) * unit[total.group(2)]) if total else sum(by_dtype.values()),
    }
    unquantized = re.search(r"([0-9.]+) (GiB|MiB) unquantized", tail)
    if unquantized:
        out["unquantized_bytes"] = int(float(unquantized.group(1)) * unit[unquantized.group(2)])
    return out


def unquantized_rest(config: dict[str, Any], element_size: int) -> int:
    """Bytes of the weights no quantization touches: the token embedding, the LM head (unless tied) and the RMS
    norms (two per layer and the final one), `element_size` bytes each."""
    hidden, vocab, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    heads = 1 if config.get("tie_word_embeddings") else 2
    return element_size * (heads * vocab * hidden + (2 * layers + 1) * hidden)


def ratios(configs: dict[str, Any], rest: int) -> dict[str, float | None]:
    """fp8's and AWQ's weight bytes over bf16's: all weights, and the linear layers alone (`rest` is what stays
    16-bit), from doctor's figures; and all weights from the engines' own count (exact)."""
    out: dict[str, float | None] = {}
    base = configs.get("bf16", {}).get("doctor_weights", {}).get("bytes")
    exact = configs.get("bf16", {}).get("engine_weights_bytes")
    for name in ("fp8", "awq"):
        row = configs.get(name, {})
        got = row.get("doctor_weights", {}).get("bytes")
        ok = bool(base and got)
        out[f"weight_ratio_{name}"] = round(got / base, 4) if ok else None
        out[f"linear_weight_ratio_{name}"] = round((got - rest) / (base - rest), 4) if ok and base > rest else None
        got = row.get("engine_weights_bytes")
        out[f"engine_weight_ratio_{name}"] = round(got / exact, 4) if exact and got else None
    return out


def complete(url: str, timeout: float) -> dict[str, Any]:
    """One completion, retried until the server answers 200 or `timeout` passes."""
    body = {"model": MODEL, "prompt": "Beautiful is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            if r.status_code == 200:
                choice = r.json()["choices"][0]
                return {"status": 200, "text": choice["text"], "tokens": r.json()["usage"]["completion_tokens"]}
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.2)
    raise TimeoutError(f"no completion within {timeout:.0f} s (last: {last})")


def serve_one(d: Deployment, timeout: float) -> dict[str, Any]:
    """opsctl start, one completion, opsctl doctor, opsctl stop: each step's outcome and seconds."""
    row: dict[str, Any] = {}
    t = time.monotonic()
    r = d.opsctl("start", timeout=timeout)
    row["opsctl_start"] = {"rc": r.returncode, "seconds": round(time.monotonic() - t, 1)}
    if r.returncode != 0:
        row["error"] = f"opsctl start exited {r.returncode}: {(r.stdout + r.stderr)[-1500:]}"
        return row
    t = time.monotonic()
    row["completion"] = complete(d.url, max(10.0, timeout - (time.monotonic() - t)))
    row["completion"]["seconds"] = round(time.monotonic() - t, 1)
    ready = d.events("engine.log", "engine_ready")
    if ready:
        row["engine_weights_by_dtype"] = ready[-1].get("weights_bytes")
        row["engine_weights_bytes"] = sum((ready[-1].get("weights_bytes") or {}).values())
        row["engine_quantization"] = ready[-1].get("quantization")
    t = time.monotonic()
    r = d.opsctl("doctor", "--json", timeout=120)
    row["doctor"] = {"rc": r.returncode, "seconds": round(time.monotonic() - t, 1)}
    try:
        checks = json.loads(r.stdout)["checks"]
    except (ValueError, KeyError):
        row["error"] = f"opsctl doctor --json printed no report: {(r.stdout + r.stderr)[-1500:]}"
        return row
    row["doctor"]["failed"] = [c["check"] for c in checks if c["status"] == "fail"]  # e.g. the KV budget: it runs
    weights = [c["detail"] for c in checks if c["check"] == "weights"]
    if not weights:
        row["error"] = f"opsctl doctor showed no weights line: {checks}"
        return row
    row["doctor_weights_line"] = weights[0]
    row["doctor_weights"] = doctor_weights(weights[0])
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the CPU dry run on the embedded model")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--configs", nargs="+", default=[c[0] for c in CONFIGS], choices=[c[0] for c in CONFIGS])
    p.add_argument("--deadline-s", type=float, default=600.0, help="stop (every engine stopped) by then")
    args = p.parse_args(argv)
    # a device run's limit sends SIGTERM: leave through the finally blocks, which stop the deployments (their
    # supervisors and engines run in sessions of their own and would keep the GPU)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    gpu = torch.cuda.is_available() and not args.quick
    if not gpu and not args.quick:
        print("error: no CUDA device; use --quick for the CPU dry run", file=sys.stderr)
        return 2
    started = time.monotonic()
    from benchmarks.kernels import device_slug

    name = device_slug(gpu)
    date = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"quant-serving-{name}-{date}.json"
    root = Path(tempfile.mkdtemp(prefix="pagekeeper-quant-serving-"))
    try:
        return _run(args, gpu, root, path, started, date, argv)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(
    args: argparse.Namespace, gpu: bool, root: Path, path: Path, started: float, date: str, argv: list[str] | None
) -> int:
    import torch

    from benchmarks.memory import model_dir
    from benchmarks.quantization import awq_model_dir
    from engine.default_model import DEFAULT_MODEL_DIR

    if gpu:
        base_dir = model_dir(quick=False)  # the 8B shape's config and the embedded tokenizer, dummy weights
    else:
        base_dir = str(root / "model")
        shutil.copytree(DEFAULT_MODEL_DIR, base_dir, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    models = {"base": base_dir, "awq": awq_model_dir(base_dir, quick=not gpu)}
    config = json.loads((Path(base_dir) / "config.json").read_text())
    common: dict[str, Any] = {"served_model_name": MODEL, "disable_log_requests": True, "swap_space": 0}
    if gpu:
        common.update(load_format="dummy", max_model_len=2048, max_num_seqs=64, enforce_eager=True)
    else:
        common.update(device="cpu", max_num_seqs=8, kv_cache_memory_bytes=16 << 20)
    supervisor = {**FAST_POLICY, "keep_weights": "off", "spare_engine": "off", "ready_timeout": 300.0}
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "date": date,
        "command": "python -m benchmarks.quant_serving " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "model_shape": "Llama-3-8B shape, random weights (load_format dummy)" if gpu else "embedded model (float32)",
        "engine": common,
        "supervisor": supervisor,
        "configs": {},
    }

    def save() -> None:
        path.write_text(json.dumps(result, indent=2) + "\n")

    deadline = started + args.deadline_s
    for cname, keys, which in CONFIGS:
        if cname not in args.configs:
            continue
        left = deadline - time.monotonic()
        if left < 30:
            result["configs"][cname] = {"skipped": f"{left:.0f} s left before the deadline"}
            save()
            continue
        engine = {"model": models[which], **common, **keys}
        if not gpu:
            engine["dtype"] = "float32"
        (root / cname).mkdir()
        d = Deployment(root / cname, engine, supervisor, _free_port())
        print(f"{cname}: opsctl start ({d.config})", flush=True)
        t = time.monotonic()
        try:
            row = serve_one(d, timeout=left - 20)
        except Exception as e:  # noqa: BLE001 - record why a configuration did not serve, keep the rest
            row = {"error": f"{type(e).__name__}: {e}"[:1500]}
        finally:
            t_stop = time.monotonic()
            d.stop()
            stop_s = round(time.monotonic() - t_stop, 1)
        row.update(engine=engine, stop_seconds=stop_s, seconds=round(time.monotonic() - t, 1))
        log = d.runtime / "engine.log"
        if "error" in row and log.exists():
            row["engine_log_tail"] = log.read_text(errors="replace")[-3000:]
        result["configs"][cname] = row
        print(f"{cname}: { ({k: row.get(k) for k in ('completion', 'doctor_weights_line', 'error')}) }", flush=True)
        save()
    result["unquantized_rest_bytes"] = unquantized_rest(config, 2 if gpu else 4)
    result.update(ratios(result["configs"], result["unquantized_rest_bytes"]))
    result["seconds"] = round(time.monotonic() - started, 1)
    save()
    for key in ("weight_ratio", "linear_weight_ratio", "engine_weight_ratio"):
        print(f"  {key}_fp8: {result[key + '_fp8']}, {key}_awq: {result[key + '_awq']}")
    print(f"wrote {path}")
    served = [c for c in args.configs if "completion" in result["configs"][c] and "error" not in result["configs"][c]]
    return 0 if len(served) == len(args.configs) else 1


if __name__ == "__main__":
    sys.exit(main())
