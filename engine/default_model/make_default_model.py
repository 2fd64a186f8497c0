"""Regenerate the embedded default checkpoint: a tiny Llama that has memorised the Zen of Python.

    python -m engine.default_model.make_default_model [--out DIR]

Deterministic (fixed seeds, deterministic torch algorithms, fixed thread count): rerunning on the same
machine with the same library versions rewrites byte-identical artifacts. Writes into DIR:

    config.json, generation_config.json, model.safetensors   (LlamaForCausalLM, float32, tied embeddings)
    tokenizer.json, tokenizer_config.json, chat_template.jinja (byte-level BPE, BOS "<s>" prepended)
    zen_prefixes.json                                         ([{"prefix", "completion"}] for every line)

Training text is the Zen of Python, taken at runtime from CPython's `this` module; each of the 19
aphorisms is one sample `<s> line </s>`. Training stops once greedy decoding from every line's unique
prefix reproduces the rest of the line and then `</s>`, with a logit margin to spare so lower-precision
kernels reproduce it too. The script then re-checks every line with `model.generate(do_sample=False)`
and exits non-zero if any line fails.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

SEED = 1234
VOCAB_SIZE = 384
MAX_SIZE_BYTES = 5 * 1024 * 1024

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]  # ids 0, 1, 2, 3

# The whole conversation, one message per line, BOS first; no generation prompt. A single user message
# holding the start of an aphorism therefore renders as `<s>` + that text: exactly what the model was
# trained on, so chat requests continue the line.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['content'] }}"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
)

MODEL_KWARGS: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    initializer_range=0.02,
    attention_bias=False,
    mlp_bias=False,
    tie_word_embeddings=True,
)

LR = 3e-3
WEIGHT_DECAY = 0.0
MAX_STEPS = 3000
CHECK_EVERY = 10
# Stop only once every completion token beats the runner-up logit by this much (teacher-forced),
# so that bf16/fp16 kernels and paged attention reproduce the same greedy output.
MIN_MARGIN = 8.0


def zen_lines() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen on first import)
    text = codecs.decode(this.s, "rot13")
    lines = text.splitlines()
    assert lines[0] == "The Zen of Python, by Tim Peters" and lines[1] == "", lines[:2]
    aphorisms = [line for line in lines[2:] if line.strip()]
    assert len(aphorisms) == 19, len(aphorisms)
    return aphorisms


def unique_prefixes(lines: list[str]) -> list[tuple[str, str]]:
    """For every line, the shortest prefix of >= 2 whole words that no other line starts with.

    The prefix always leaves at least one word to complete (for the two-word "Readability counts." that
    means a one-word prefix). Returns (prefix, completion) with prefix + completion == line; the
    completion keeps its leading space.
    """
    out = []
    for line in lines:
        words = line.split(" ")
        others = [o for o in lines if o != line]
        chosen = None
        for n in range(min(2, len(words) - 1), len(words)):
            prefix = " ".join(words[:n])
            if not any(o == prefix or o.startswith(prefix + " ") for o in others):
                chosen = prefix
                break
        if chosen is None:
            raise ValueError(f"no unique prefix for {line!r}")
        out.append((chosen, line[len(chosen) :]))
        assert chosen + out[-1][1] == line
    return out


def build_tokenizer(lines: list[str]):
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=MODEL_KWARGS["max_position_embeddings"],
        padding_side="right",
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids (4.x default adds them)
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_batch(tokenizer, lines: list[str]):
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    seqs = []
    for line in lines:
        ids = tokenizer(line, add_special_tokens=True)["input_ids"]
        assert ids[0] == bos and bos not in ids[1:]
        seqs.append(ids + [eos])
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = 1
        labels[i, : len(s)] = torch.tensor(s)
    return seqs, input_ids, attention, labels


def completion_mask(tokenizer, seqs, pairs, width):
    """mask[i, t] is True where logits at position t must predict a completion token (or the EOS)."""
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, (s, (prefix, _)) in enumerate(zip(seqs, pairs)):
        p = tokenizer(prefix, add_special_tokens=True)["input_ids"]
        assert s[: len(p)] == p, (prefix, p, s)  # prefix tokens are a prefix of the line's tokens
        mask[i, len(p) - 1 : len(s) - 1] = True
    return mask


@torch.no_grad()
def teacher_forced_check(model, input_ids, attention, mask):
    """Exact stand-in for greedy decoding: all argmaxes right <=> greedy follows the line. Returns
    (number of wrong positions, minimum top1-top2 margin over the completion positions)."""
    model.eval()
    logits = model(input_ids=input_ids, attention_mask=attention).logits.float()
    model.train()
    target = input_ids[:, 1:]
    logits = logits[:, :-1]
    m = mask[:, :-1]
    tgt_logit = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    other = logits.scatter(-1, target.unsqueeze(-1), float("-inf")).amax(-1)
    margin = (tgt_logit - other)[m]
    return int((margin <= 0).sum()), float(margin.min())


@torch.no_grad()
def verify_with_generate(model, tokenizer, lines, pairs) -> list[str]:
    failures = []
    model.eval()
    for line, (prefix, completion) in zip(lines, pairs):
        enc = tokenizer(prefix, return_tensors="pt", add_special_tokens=True)
        out = model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=64,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        new = out[0, enc["input_ids"].shape[1] :].tolist()
        text = tokenizer.decode(new, skip_special_tokens=True)
        ok = prefix + text == line and new and new[-1] == tokenizer.eos_token_id
        ok = ok and tokenizer.eos_token_id not in new[:-1]
        if not ok:
            failures.append(f"{prefix!r} -> {text!r} (tokens {new}); expected {completion!r} + </s>")
    return failures


def _portable_tokenizer_config(path: Path) -> None:
    """transformers 5 writes tokenizer_class "TokenizersBackend", which 4.x cannot resolve; the 4.x name
    "PreTrainedTokenizerFast" is an alias for the same class in 5.x, so write that instead."""
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if cfg.get("tokenizer_class") in (None, "TokenizersBackend"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and "__pycache__" not in f.parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = ap.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(2)
    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()

    t0 = time.perf_counter()
    lines = zen_lines()
    pairs = unique_prefixes(lines)
    tokenizer = build_tokenizer(lines)
    seqs, input_ids, attention, labels = build_batch(tokenizer, lines)
    mask = completion_mask(tokenizer, seqs, pairs, input_ids.shape[1])

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **MODEL_KWARGS,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).float()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.98))

    step, loss_val, wrong, margin = 0, float("nan"), -1, float("-inf")
    for step in range(1, MAX_STEPS + 1):
        # Full batch (19 lines), linear warmup over the first 20 steps.
        for g in opt.param_groups:
            g["lr"] = LR * min(1.0, step / 20)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val = float(loss.detach())
        if step % CHECK_EVERY == 0:
            wrong, margin = teacher_forced_check(model, input_ids, attention, mask)
            if wrong == 0 and margin >= MIN_MARGIN:
                break
    train_s = time.perf_counter() - t0

    model.eval()
    failures = verify_with_generate(model, tokenizer, lines, pairs)
    # The engine may run the checkpoint in bf16: check the margin is enough for that too.
    import copy

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    failures += [f"[bf16] {f_}" for f_ in verify_with_generate(bf16, tokenizer, lines, pairs)]
    del bf16

    model.generation_config.do_sample = False
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_config(out / "tokenizer_config.json")
    with open(out / "zen_prefixes.json", "w", encoding="utf-8") as f:
        json.dump([{"prefix": p, "completion": c} for p, c in pairs], f, indent=1, ensure_ascii=False)
        f.write("\n")
    for path in out.iterdir():
        if path.is_file() and path.suffix in {".json", ".jinja", ".safetensors"}:
            path.chmod(0o644)  # save_pretrained may write 0600 via a temp file

    size = dir_size(out)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"default model: {n_params:,} params, vocab {len(tokenizer)}, {step} steps, "
        f"final loss {loss_val:.4f}, min margin {margin:.2f}, {train_s:.1f}s, "
        f"{size / 1024 / 1024:.2f} MiB -> {out}"
    )
    ok = True
    if failures:
        print(f"FAIL: {len(failures)}/{len(lines)} lines not reproduced by greedy generate:", file=sys.stderr)
        for f_ in failures:
            print("  " + f_, file=sys.stderr)
        ok = False
    if wrong != 0 or margin < MIN_MARGIN:
        print(f"FAIL: training did not converge (wrong={wrong}, margin={margin:.2f})", file=sys.stderr)
        ok = False
    if size > MAX_SIZE_BYTES:
        print(f"FAIL: {out} is {size} bytes > {MAX_SIZE_BYTES}", file=sys.stderr)
        ok = False
    if ok:
        print(f"verified: greedy generate reproduces all {len(lines)} lines")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
