"""Which grammar engine for structured outputs: llguidance vs xgrammar, measured on this machine.

For each of N generated JSON schemas: the compile time (schema -> a matcher ready for its first mask),
then one valid instance is tokenized and walked token by token, timing the per-token mask computation
(what the engine pays per structured request per decode step) and checking the instance is accepted.
The tokenizer is a byte-level BPE trained here (no downloads): `--vocab` tokens (32k by default,
the size class of Llama-2/Mistral; 128k+ vocabularies cost proportionally more per mask).

    python3 -m benchmarks.grammar_engines --schemas 20 --out benchmarks/results/grammar-engines-cpu-<date>.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.json_schemas import instance_of, random_schemas


def train_tokenizer(vocab: int) -> Any:
    """A byte-level BPE of `vocab` tokens trained on this Python's standard library sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lib = Path(json.__file__).parent.parent
    files = sorted(str(p) for p in lib.glob("*.py"))[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train(files, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def bench_llguidance(hf_tok: Any, schemas: list[dict], texts: list[str]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf_tok)
    setup = time.perf_counter() - t0
    bitmask = lt.allocate_token_bitmask(1, tokenizer.vocab_size)
    compile_s, mask_s, accepted = [], [], 0
    for schema, text in zip(schemas, texts):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        lt.fill_next_token_bitmask(matcher, bitmask, 0)
        compile_s.append(time.perf_counter() - t0)
        ok = True
        for token in hf_tok(text, add_special_tokens=False)["input_ids"]:
            if not matcher.consume_token(token):
                ok = False
                break
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(matcher, bitmask, 0)
            mask_s.append(time.perf_counter() - t0)
        accepted += ok and matcher.is_accepting()
    return _summary("llguidance", _version("llguidance"), setup, compile_s, mask_s, accepted, len(schemas))


def bench_xgrammar(hf_tok: Any, schemas: list[dict], texts: list[str]) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tok)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    compile_s, mask_s, accepted = [], [], 0
    for schema, text in zip(schemas, texts):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        matcher = xgr.GrammarMatcher(compiled)
        matcher.fill_next_token_bitmask(bitmask)
        compile_s.append(time.perf_counter() - t0)
        ok = True
        for token in hf_tok(text, add_special_tokens=False)["input_ids"]:
            if not matcher.accept_token(token):
                ok = False
                break
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            mask_s.append(time.perf_counter() - t0)
        accepted += ok and matcher.accept_token(hf_tok.eos_token_id)
    return _summary("xgrammar", _version("xgrammar"), setup, compile_s, mask_s, accepted, len(schemas))


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _summary(name: str, version: str, setup: float, compile_s: list, mask_s: list, accepted: int, n: int) -> dict:
    ms = sorted(x * 1e3 for x in mask_s)
    return {
        "engine": name,
        "version": version,
        "tokenizer_setup_s": round(setup, 3),
        "compile_ms_median": round(statistics.median(compile_s) * 1e3, 2),
        "compile_ms_max": round(max(compile_s) * 1e3, 2),
        "mask_ms_median": round(statistics.median(ms), 4),
        "mask_ms_p99": round(ms[int(0.99 * (len(ms) - 1))], 4),
        "mask_ms_max": round(ms[-1], 4),
        "tokens_walked": len(ms),
        "instances_accepted": f"{accepted}/{n}",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hf_tok = train_tokenizer(args.vocab)
    schemas = random_schemas(args.schemas, seed=0)
    texts = [json.dumps(instance_of(s, seed=i), separators=(",", ":")) for i, s in enumerate(schemas)]
    results = {
        "what": "grammar engine cost per JSON-schema request: compile, then per-token mask (1 thread)",
        "command": "python3 -m benchmarks.grammar_engines " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread",
        "date": time.strftime("%Y-%m-%d"),
        "vocab": len(hf_tok),
        "schemas": args.schemas,
        "engines": [bench_llguidance(hf_tok, schemas, texts), bench_xgrammar(hf_tok, schemas, texts)],
    }
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
