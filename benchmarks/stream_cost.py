"""What one streamed token costs the server, at 64 and at 4,096 output tokens.

A server that rebuilds a request's whole output every step (and cuts the new part back out) pays
O(tokens so far) per token, so a long stream gets slower per token as it grows.  This measures one
streamed completion against a real `python -m engine.server` on a small random-weight Llama
checkpoint (hidden 64, 2 layers: the model's own cost per token is small, so the serving path's
shows), at each output length:

- `stream_ms_per_token`: client-side, first to last streamed chunk / (tokens - 1);
- `engine_ms_per_token`: the same request through the offline engine in this process (no HTTP, one
  final output), the cost that does not depend on the serving path;
- `server_overhead_ms_per_token`: the difference.

    python -m benchmarks.stream_cost [--lengths 64 4096] [--repeats 3] [--out benchmarks/results/F.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serving import started_server

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "engine" / "default_model"
PROMPT_IDS = [11, 12, 13, 14, 15, 16, 17, 18]


def make_checkpoint(root: Path, max_len: int) -> Path:
    """A tiny Llama with random weights and the embedded model's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((DEFAULT_MODEL / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
    )
    path = root / "tiny-llama"
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, path / name)
    return path


def stream_once(url: str, model: str, max_tokens: int) -> dict[str, Any]:
    payload = {
        "model": model,
        "prompt": PROMPT_IDS,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times: list[float] = []
    tokens = 0
    with httpx.stream("POST", url + "/v1/completions", json=payload, timeout=600, trust_env=False) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event["choices"]:
                times.append(time.perf_counter())
            elif event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    assert tokens == max_tokens, f"{tokens} tokens streamed, {max_tokens} asked for"
    # A chunk may carry more than one token when the client reads slower than the engine steps.
    return {"chunks": len(times), "ms_per_token": 1000 * (times[-1] - times[0]) / (tokens - 1)}


def engine_once(llm: Any, max_tokens: int) -> float:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": PROMPT_IDS}], params, use_tqdm=False)  # warm
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": PROMPT_IDS}], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert len(out[0].outputs[0].token_ids) == max_tokens
    return 1000 * elapsed / max_tokens


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.stream_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    max_len = max(args.lengths) + len(PROMPT_IDS) + 8
    rows: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="stream-cost-") as tmp:
        ckpt = make_checkpoint(Path(tmp), max_len)
        server_args = [
            "--model",
            str(ckpt),
            "--max-model-len",
            str(max_len),
            "--served-model-name",
            "tiny",
            "--disable-log-requests",
        ]
        with started_server(server_args, timeout=180, log_path=None) as server:
            for n in args.lengths:
                stream_once(server.url, "tiny", min(n, 32))  # warm
                runs = [stream_once(server.url, "tiny", n)["ms_per_token"] for _ in range(args.repeats)]
                rows[n] = {
                    "stream_ms_per_token": round(statistics.median(runs), 4),
                    "stream_runs_ms_per_token": [round(r, 4) for r in runs],
                }
        from engine.llm import LLM

        llm = LLM(str(ckpt), max_model_len=max_len)
        for n in args.lengths:
            runs = [engine_once(llm, n) for _ in range(args.repeats)]
            rows[n]["engine_ms_per_token"] = round(statistics.median(runs), 4)
            rows[n]["server_overhead_ms_per_token"] = round(
                rows[n]["stream_ms_per_token"] - rows[n]["engine_ms_per_token"], 4
            )
    lo, hi = min(args.lengths), max(args.lengths)
    result = {
        "what": "one streamed completion's per-token cost, python -m benchmarks.stream_cost",
        "command": "python -m benchmarks.stream_cost " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "date": date.today().isoformat(),
        "lengths": {str(n): r for n, r in rows.items()},
        f"stream_ratio_{hi}_vs_{lo}": round(rows[hi]["stream_ms_per_token"] / rows[lo]["stream_ms_per_token"], 3),
        f"engine_ratio_{hi}_vs_{lo}": round(rows[hi]["engine_ms_per_token"] / rows[lo]["engine_ms_per_token"], 3),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
