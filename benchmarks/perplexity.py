"""Issue 39's accuracy check: a small Llama trained for real, its perplexity in bf16, FP8 weights, FP8 KV and AWQ.

    python -m benchmarks.perplexity --out DIR                    # one GPU: train ~150 s, then the four engines
    python -m benchmarks.perplexity --quick --out DIR            # the CPU dry run: a tiny model, seconds of training
    python -m benchmarks.perplexity --out DIR --merge Q.json     # also write the ppl_ratio_* keys into Q.json
    python -m benchmarks.perplexity --merge Q.json --from P.json # only the merge, from an earlier run's file

On random weights a quantized model's logit error is noise, so accuracy is measured on a model that learned
something: the Python standard library's sources (the running interpreter's, available offline), split by file
into training and held-out text (a file's CRC-32 decides, so every run splits alike).  A byte-level BPE
tokenizer (the `tokenizers` library) and a Llama (GQA, every width a multiple of 128 so the FP8 and AWQ kernels'
tiles fit; AWQ groups of 128) are trained with plain torch (AdamW, warm-up then cosine decay over a fixed time
budget, bf16 autocast over fp32 weights), saved with `save_pretrained` in bf16, and quantized to an AutoAWQ
checkpoint by the project's quantizer (engine/model/quantize.py).

Every figure comes from pagekeeper's own engine (engine.LLM, offline), one engine at a time, all with the same
flags but the one measured: bf16; `quantization="fp8"` at load; `kv_cache_dtype="fp8"`; the AWQ checkpoint
(float16).  Perplexity: held-out windows of `--window` tokens (the first token of each unscored), each token's
log-probability from `prompt_logprobs`; ppl = exp(-sum / count) over every scored token.  Greedy agreement: 64
held-out prompts, `--gen` greedy tokens each, against bf16's: the mean fraction of tokens before the first
divergence and the fraction of prompts fully equal.  Sanity: transformers' own forward of the trained model on
the same windows, whose perplexity the bf16 engine's must match (`ppl_engine_over_transformers`).

Writes `<out>/perplexity-<gpu>-<date>.json` (rewritten after every phase): `ppl_bf16`, `ppl_fp8`, `ppl_fp8_kv`,
`ppl_awq`, `ppl_ratio_*` (over bf16; targets: FP8 and FP8 KV within 1 %, AWQ within 5 %), the agreement rates,
the training config, steps, final train loss, tokens seen, seconds per phase, GPU, date and command.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
import traceback
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

RESULTS = Path(__file__).resolve().parent / "results"
SPECIALS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2: BOS, EOS (between files), padding
HELDOUT_EVERY = 10  # a file whose path's CRC-32 is 0 mod this is held out (~10 % of the text)
# (name, engine flags, checkpoint: "bf16" or "awq"); the CPU dry run replaces 16-bit dtypes with float32
CONFIGS: list[tuple[str, dict[str, Any], str]] = [
    ("bf16", {"dtype": "bfloat16"}, "bf16"),
    ("fp8", {"dtype": "bfloat16", "quantization": "fp8"}, "bf16"),
    ("fp8_kv", {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}, "bf16"),
    ("awq", {"dtype": "float16", "quantization": "awq"}, "awq"),
]
RATIO_KEYS = {"fp8": "ppl_ratio_fp8", "fp8_kv": "ppl_ratio_fp8_kv", "awq": "ppl_ratio_awq"}


@dataclass(frozen=True)
class ModelShape:
    """The trained Llama: widths multiples of 128 (the FP8 and AWQ tiles, AWQ groups of 128), GQA heads."""

    vocab_size: int = 8192
    hidden_size: int = 768
    intermediate_size: int = 2304
    num_hidden_layers: int = 8
    num_attention_heads: int = 6
    num_key_value_heads: int = 3
    head_dim: int = 128
    max_position_embeddings: int = 1024


QUICK_SHAPE = ModelShape(
    vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=256,
)  # fmt: skip


@dataclass(frozen=True)
class TrainConfig:
    seconds: float = 150.0
    batch_size: int = 32
    seq_len: int = 512
    lr: float = 8e-4
    min_lr_fraction: float = 0.1
    warmup_fraction: float = 0.03
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0


# -- the text ------------------------------------------------------------------------------------


def python_files(root: Path) -> list[Path]:
    """The *.py files under `root`, not descending into installed packages (a pyenv or conda stdlib holds its
    site-packages, gigabytes of them) or caches."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        out += [Path(folder) / f for f in sorted(files) if f.endswith(".py")]
    return out


def default_corpus(min_bytes: int = 4_000_000) -> list[Path]:
    """The running interpreter's standard library; where an image ships too little of its source (compiled files
    only), torch's Python sources beside it."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    if sum(p.stat().st_size for p in python_files(roots[0])) < min_bytes:
        import torch

        roots.append(Path(torch.__file__).parent)
    return roots


def split_corpus(roots: Sequence[Path], max_bytes: int | None = None) -> tuple[list[str], list[str]]:
    """The *.py files under `roots` (not installed packages below them) as (training, held-out) texts, split by
    file: a file's path relative to its root decides, so a run anywhere splits the same sources alike.
    `max_bytes` keeps the first files (sorted by path) up to that many bytes of text (the CPU dry run)."""
    train: list[str] = []
    held: list[str] = []
    total = 0
    for path, rel in sorted((p, p.relative_to(root).as_posix()) for root in roots for p in python_files(root)):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # a few test files are deliberately not UTF-8
        if not text.strip():
            continue
        (held if zlib.crc32(rel.encode()) % HELDOUT_EVERY == 0 else train).append(text)
        total += len(text)
        if max_bytes is not None and total >= max_bytes and held and train:
            break
    if not train or not held:
        raise SystemExit(f"error: too few Python sources under {', '.join(map(str, roots))} to split in two")
    return train, held


def train_tokenizer(texts: Sequence[str], vocab_size: int, max_chars: int = 10_000_000) -> Any:
    """A byte-level BPE tokenizer (every byte encodable), as transformers' PreTrainedTokenizerFast; trained on
    at most `max_chars` characters of `texts` (beyond a few MB the merges barely change, the time does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sample: list[str] = []
    used = 0
    for t in texts:
        if used >= max_chars:
            break
        sample.append(t)
        used += len(t)
    tok.train_from_iterator(sample, trainer=trainer)
    bos, eos, pad = SPECIALS
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, clean_up_tokenization_spaces=False
    )


def encode_stream(tokenizer: Any, texts: Sequence[str]) -> Any:
    """Every text's tokens, each followed by EOS (the files run on as one stream, as in training), as one
    int32 numpy array: the Rust tokenizer's batch call, without transformers' per-token Python lists."""
    import numpy as np

    backend = tokenizer.backend_tokenizer
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # tokenizers >= 0.21: no offsets
    eos = np.asarray([tokenizer.eos_token_id], dtype=np.int32)
    parts = []
    for enc in encode(list(texts), add_special_tokens=False):
        parts += [np.asarray(enc.ids, dtype=np.int32), eos]
    return np.concatenate(parts)


# -- the arithmetic ------------------------------------------------------------------------------


def windows(stream: Sequence[int], length: int, count: int) -> list[list[int]]:
    """`count` non-overlapping windows of `length` tokens spread evenly over the stream (all of them when it
    holds fewer)."""
    if length < 2:
        raise ValueError("a window needs at least 2 tokens (its first one is not scored)")
    full = len(stream) // length
    picks = range(full) if count >= full else (i * full // count for i in range(count))
    return [list(stream[j * length : (j + 1) * length]) for j in picks]


def greedy_prompts(stream: Sequence[int], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens spread evenly over the stream, each starting half a stride in (so
    not at a window's opening); fewer when the stream is short."""
    stride = max(1, len(stream) // count)
    starts = (i * stride + stride // 2 for i in range(count))
    return [list(stream[s : s + length]) for s in starts if s + length <= len(stream)]


def perplexity(logprobs: Sequence[Sequence[float]]) -> float:
    """exp of the mean negative log-likelihood over every scored token of every window (not a mean of the
    windows' perplexities: a window counts by its tokens)."""
    count = sum(len(w) for w in logprobs)
    if count == 0:
        raise ValueError("no scored tokens")
    return math.exp(-sum(sum(w) for w in logprobs) / count)


def agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> dict[str, float]:
    """Greedy outputs against the reference's, prompt by prompt: `prefix`, the mean fraction of each output
    before its first differing token; `full`, the fraction of prompts whose output is equal throughout."""
    if len(reference) != len(other) or not reference:
        raise ValueError(f"{len(reference)} reference outputs against {len(other)}")
    fractions = []
    for ref, got in zip(reference, other):
        same = 0
        for a, b in zip(ref, got):
            if a != b:
                break
            same += 1
        if len(ref) != len(got):
            same = min(same, len(ref), len(got))
        fractions.append(same / max(1, len(ref)))
    return {
        "prefix": round(sum(fractions) / len(fractions), 4),
        "full": round(sum(f == 1.0 for f in fractions) / len(fractions), 4),
    }


def mean_abs_diff(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """Mean |difference| of two runs' per-token log-probabilities (same windows)."""
    diffs = [abs(x - y) for wa, wb in zip(a, b) for x, y in zip(wa, wb)]
    return sum(diffs) / max(1, len(diffs))


def prompt_token_logprobs(out: Any) -> list[float]:
    """The engine's prompt_logprobs as one float per prompt token after the first (that token's own)."""
    ids = out.prompt_token_ids
    entries = out.prompt_logprobs
    if entries is None or len(entries) != len(ids):
        raise RuntimeError(f"prompt_logprobs missing or short: {None if entries is None else len(entries)}")
    return [entries[i][ids[i]].logprob for i in range(1, len(ids))]


# -- training ------------------------------------------------------------------------------------


def lr_at(cfg: TrainConfig, progress: float) -> float:
    """Linear warm-up, then cosine decay to `min_lr_fraction`, over the fraction of the time budget spent."""
    if progress < cfg.warmup_fraction:
        return cfg.lr * max(progress / cfg.warmup_fraction, 0.01)
    t = min(1.0, (progress - cfg.warmup_fraction) / (1 - cfg.warmup_fraction))
    floor = cfg.lr * cfg.min_lr_fraction
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * t))


def build_model(shape: ModelShape, tokenizer: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **asdict(shape),
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )
    return LlamaForCausalLM(config)


def train(model: Any, data: Any, cfg: TrainConfig, device: Any, log_every: int = 50) -> dict[str, Any]:
    """Train on random `seq_len + 1` slices of the token tensor `data` until the time budget is spent."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(cfg.seed)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)  # offsets drawn where the data is: no copy per step
    model.train()
    cuda = device.type == "cuda"
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        fused=cuda,
    )
    span = cfg.seq_len + 1
    if len(data) <= span:
        raise SystemExit(f"error: {len(data)} training tokens, fewer than one sequence of {span}")
    offsets = torch.arange(span, device=device)
    data = data.to(device)
    losses: list[float] = []
    steps = 0
    started = time.monotonic()
    while True:
        elapsed = time.monotonic() - started
        if elapsed >= cfg.seconds and steps > 0:
            break
        lr = lr_at(cfg, elapsed / cfg.seconds)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - span, (cfg.batch_size,), generator=gen, device=device)
        batch = data[starts[:, None] + offsets]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        steps += 1
        if steps % log_every == 0 or steps == 1:
            losses.append(float(loss.detach()))  # a sync: the host never runs far ahead of the budget
            print(f"  step {steps}: loss {losses[-1]:.3f}, lr {lr:.2e}, {time.monotonic() - started:.0f} s", flush=True)
    final = float(loss.detach())
    model.eval()
    return {
        "steps": steps,
        "seconds": round(time.monotonic() - started, 1),
        "tokens_seen": steps * cfg.batch_size * cfg.seq_len,
        "final_train_loss": round(final, 4),
        "first_train_loss": round(losses[0], 4) if losses else None,
        "loss_curve": [round(x, 4) for x in losses[:: max(1, len(losses) // 20)]],
    }


def transformers_logprobs(
    model: Any, wins: list[list[int]], device: Any, dtype: Any, batch: int = 16
) -> list[list[float]]:
    """transformers' own forward of the trained model on the windows: each token's log-probability (after the
    first), in `dtype` as the engine runs it."""
    import torch

    model = model.to(dtype)
    out: list[list[float]] = []
    with torch.inference_mode():
        for i in range(0, len(wins), batch):
            ids = torch.tensor(wins[i : i + batch], device=device)
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
            chosen = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
            out.extend(chosen.cpu().tolist())
    return out


# -- the engines ---------------------------------------------------------------------------------


def run_engine(
    model: str, flags: dict[str, Any], base: dict[str, Any], wins: list[list[int]], prompts: list[list[int]], gen: int
) -> tuple[list[list[float]], list[list[int]], dict[str, Any]]:
    """One engine: the windows' prompt log-probabilities, then greedy outputs of the prompts."""
    from benchmarks.throughput import _free
    from engine import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(model, **base, **flags)
    try:
        loaded = time.monotonic() - started
        plan = llm.llm_engine.core.kv_plan
        score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": w} for w in wins], score, use_tqdm=False)
        lps = [prompt_token_logprobs(o) for o in outs]
        scored = time.monotonic() - started - loaded
        greedy = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        info = {
            "flags": flags,
            "weights_bytes": plan.weights_bytes,
            "weights_by_dtype": plan.weights_by_dtype,
            "kv_dtype": plan.kv_dtype,
            "seconds": {
                "start": round(loaded, 1),
                "perplexity": round(scored, 1),
                "greedy": round(time.monotonic() - started - loaded - scored, 1),
            },
        }
        return lps, tokens, info
    finally:
        llm.close()
        llm = None  # type: ignore[assignment]
        _free()


# -- results -------------------------------------------------------------------------------------


def ratios(result: dict[str, Any]) -> dict[str, float | None]:
    """Each quantized configuration's perplexity over bf16's (None where either did not run)."""
    bf16 = result.get("ppl_bf16")
    out: dict[str, float | None] = {}
    for name, key in RATIO_KEYS.items():
        ppl = result.get(f"ppl_{name}")
        out[key] = round(ppl / bf16, 5) if bf16 and ppl else None
    return out


def merge(into: Path, result: dict[str, Any], source: str) -> None:
    """The ppl_ratio_* keys (and a short summary) into benchmarks/quantization.py's results file."""
    data = json.loads(into.read_text())
    if not isinstance(data, dict):
        raise SystemExit(f"error: {into} does not hold a JSON object")
    for key in RATIO_KEYS.values():
        data[key] = result.get(key)
    data["perplexity"] = {
        "source": source,
        **{k: result.get(k) for k in ("ppl_bf16", "ppl_fp8", "ppl_fp8_kv", "ppl_awq", "greedy_agreement")},
    }
    into.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the CPU dry run: tiny model, a few seconds of training")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--train-seconds", type=float, default=None, help="training budget (default 150; --quick 4)")
    p.add_argument("--corpus", type=Path, default=None, help="a folder of *.py (default: the stdlib's)")
    p.add_argument("--vocab", type=int, default=None, help="tokenizer vocabulary (default 8192; --quick 512)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size, a multiple of 128 (default 768; --quick 256)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8)")
    p.add_argument("--window", type=int, default=None, help="perplexity window in tokens (default 512; --quick 64)")
    p.add_argument("--windows", type=int, default=None, help="held-out windows scored (default 256; --quick 8)")
    p.add_argument("--prompts", type=int, default=64, help="greedy prompts")
    p.add_argument("--prompt-len", type=int, default=None, help="greedy prompt tokens (default 64; --quick 16)")
    p.add_argument("--gen", type=int, default=None, help="greedy tokens per prompt (default 64; --quick 8)")
    p.add_argument("--configs", nargs="+", default=[c[0] for c in CONFIGS], choices=[c[0] for c in CONFIGS])
    p.add_argument("--keep", type=Path, default=None, help="write the checkpoints here (default: a temp dir)")
    p.add_argument("--merge", type=Path, default=None, help="write the ppl_ratio_* keys into this results JSON")
    p.add_argument("--from", dest="source", type=Path, default=None, help="with --merge: merge this file, run nothing")
    args = p.parse_args(argv)
    if args.source is not None:
        if args.merge is None:
            p.error("--from needs --merge")
        merge(args.merge, json.loads(args.source.read_text()), args.source.name)
        print(f"merged {args.source} into {args.merge}")
        return 0
    if "bf16" not in args.configs:
        p.error("--configs needs bf16 (every ratio is over it)")
    if args.merge is not None and not args.merge.is_file():
        p.error(f"--merge {args.merge}: no such file")
    return run(args, sys.argv[1:] if argv is None else argv)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    from benchmarks.throughput import _free

    gpu = torch.cuda.is_available() and not args.quick
    if not gpu and not args.quick:
        print("error: no CUDA device; use --quick for the CPU dry run", file=sys.stderr)
        return 2
    device = torch.device("cuda" if gpu else "cpu")
    base_shape = ModelShape() if gpu else QUICK_SHAPE
    hidden = args.hidden or base_shape.hidden_size
    if hidden % 128:
        print(f"error: --hidden {hidden} is not a multiple of 128 (the FP8 and AWQ tiles)", file=sys.stderr)
        return 2
    shape = ModelShape(
        vocab_size=args.vocab or base_shape.vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=args.layers or base_shape.num_hidden_layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 256 if hidden % 256 == 0 else 1,  # GQA: 2 query heads per KV head
        head_dim=128,
        max_position_embeddings=base_shape.max_position_embeddings,
    )
    window = args.window or (512 if gpu else 64)
    cfg = TrainConfig(
        seconds=args.train_seconds if args.train_seconds is not None else (150.0 if gpu else 4.0),
        batch_size=32 if gpu else 4,
        seq_len=min(512, shape.max_position_embeddings - 1) if gpu else 64,
    )
    if window + 1 > shape.max_position_embeddings:
        print(f"error: --window {window} does not fit {shape.max_position_embeddings} positions", file=sys.stderr)
        return 2
    prompt_len, gen = args.prompt_len or (64 if gpu else 16), args.gen or (64 if gpu else 8)
    from benchmarks.kernels import device_slug

    name = device_slug(gpu)
    date = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"perplexity-{name}-{date}.json"
    corpus = [args.corpus] if args.corpus else default_corpus()
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "date": date,
        "command": "python -m benchmarks.perplexity " + " ".join(argv),
        "torch": torch.__version__,
        "corpus": {"roots": [str(c) for c in corpus], "heldout": f"files whose path's CRC-32 is 0 mod {HELDOUT_EVERY}"},
        "model": asdict(shape),
        "train": asdict(cfg),
        "eval": {"window": window, "prompts": args.prompts, "prompt_len": prompt_len, "gen": gen},
        "seconds": {},
    }

    def save() -> None:
        path.write_text(json.dumps(result, indent=2) + "\n")

    def phase(label: str, since: float) -> None:
        result["seconds"][label] = round(time.monotonic() - since, 1)
        save()
        print(f"{label}: {result['seconds'][label]} s", flush=True)

    t = time.monotonic()
    train_texts, held_texts = split_corpus(corpus, max_bytes=None if gpu else 400_000)
    tokenizer = train_tokenizer(train_texts, shape.vocab_size, max_chars=10_000_000 if gpu else 200_000)
    train_ids = encode_stream(tokenizer, train_texts)
    held_ids = encode_stream(tokenizer, held_texts)
    result["corpus"].update(
        files_train=len(train_texts),
        files_heldout=len(held_texts),
        tokens_train=len(train_ids),
        tokens_heldout=len(held_ids),
        bytes_per_token=round(sum(map(len, train_texts)) / len(train_ids), 3),
    )
    phase("data", t)

    t = time.monotonic()
    torch.manual_seed(cfg.seed)
    model = build_model(shape, tokenizer).to(device)
    result["model"]["parameters"] = sum(p.numel() for p in model.parameters())
    data = torch.from_numpy(train_ids).long()
    result["training"] = train(model, data, cfg, device)
    del data
    phase("train", t)

    t = time.monotonic()
    root = args.keep or Path(tempfile.mkdtemp(prefix="pagekeeper-ppl-"))
    ckpt, awq_dir = root / "model", root / "model-awq"
    model.to(torch.bfloat16).save_pretrained(str(ckpt), safe_serialization=True)
    tokenizer.save_pretrained(str(ckpt))
    from engine.model.quantize import write_awq

    write_awq(ckpt, awq_dir, 128)
    phase("checkpoints", t)

    wins = windows(held_ids.tolist(), window, args.windows or (256 if gpu else 8))
    prompts = greedy_prompts(held_ids.tolist(), args.prompts, prompt_len)
    result["eval"].update(windows=len(wins), scored_tokens=len(wins) * (window - 1), prompts=len(prompts))
    t = time.monotonic()
    ref_dtype = torch.bfloat16 if gpu else torch.float32
    hf = transformers_logprobs(model, wins, device, ref_dtype)
    result["ppl_transformers"] = round(perplexity(hf), 5)
    del model
    _free()
    phase("transformers", t)

    base: dict[str, Any] = dict(
        device=device.type,
        max_model_len=max(window + 1, prompt_len + gen),
        max_num_seqs=64,
        swap_space=0,
        enforce_eager=True,  # the model is tiny: graph capture would take longer than every step it saves
        kv_cache_memory_bytes=(1 << 30) if gpu else (16 << 20),
        seed=0,
    )
    result["engine_args"] = base
    engines: dict[str, Any] = {}
    result["engines"] = engines
    lps: dict[str, list[list[float]]] = {}
    outs: dict[str, list[list[int]]] = {}
    models = {"bf16": str(ckpt), "awq": str(awq_dir)}
    for cname, flags, which in CONFIGS:
        if cname not in args.configs:
            continue
        if not gpu:
            flags = {**flags, "dtype": "float32"}  # the CPU dry run: bf16 matmuls are slow on CPUs
        t = time.monotonic()
        try:
            lps[cname], outs[cname], engines[cname] = run_engine(models[which], flags, base, wins, prompts, gen)
            result[f"ppl_{cname}"] = round(perplexity(lps[cname]), 5)
            engines[cname]["ppl"] = result[f"ppl_{cname}"]
            print(f"{cname}: ppl {result[f'ppl_{cname}']}", flush=True)
            if cname == "bf16":
                result["ppl_engine_over_transformers"] = round(result["ppl_bf16"] / result["ppl_transformers"], 5)
                result["logprob_mean_abs_diff_vs_transformers"] = round(mean_abs_diff(lps["bf16"], hf), 6)
            elif "bf16" in outs:
                result.setdefault("greedy_agreement", {})[cname] = agreement(outs["bf16"], outs[cname])
                diff = mean_abs_diff(lps[cname], lps["bf16"])
                engines[cname]["logprob_mean_abs_diff_vs_bf16"] = round(diff, 6)
        except Exception as e:  # noqa: BLE001 - record why a configuration could not run, keep the rest
            engines[cname] = {"flags": flags, "error": f"{type(e).__name__}: {e}"[:800]}
            engines[cname]["traceback_tail"] = traceback.format_exc()[-2500:]
            print(f"{cname}: failed: {engines[cname]['error']}", flush=True)
        _free()
        result.update(ratios(result))  # kept as each engine ends: a stage stopped at its limit keeps them
        phase(f"engine_{cname}", t)
    result["wall_s"] = round(sum(result["seconds"].values()), 1)
    save()
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    if args.merge is not None:
        merge(args.merge, result, path.name)
        print(f"merged the ppl ratios into {args.merge}")
    for key in ("ppl_transformers", "ppl_bf16", "ppl_engine_over_transformers", *RATIO_KEYS.values()):
        print(f"  {key}: {result.get(key)}")
    print(f"  greedy_agreement: {result.get('greedy_agreement')}")
    print(f"wrote {path}")
    failed = [c for c in args.configs if "error" in engines.get(c, {"error": 1})]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
