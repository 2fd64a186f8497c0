"""Small random-weight HF checkpoints made with transformers' own save_pretrained.

Every architecture pagekeeper supports gets one, so parity tests compare against transformers on
checkpoints written exactly as real ones are.  They reuse the embedded model's tokenizer (copied
next to the weights) because a checkpoint directory must be loadable on its own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from engine.default_model import DEFAULT_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
ARCHS = ("llama", "qwen2", "qwen3", "opt")


def _config(arch: str, vocab: int):
    from transformers import LlamaConfig, OPTConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=10000.0,
            **common,
        )
    if arch == "qwen2":
        return Qwen2Config(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            **common,
        )
    if arch == "qwen3":
        return Qwen3Config(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            **common,
        )
    if arch == "opt":
        common.pop("tie_word_embeddings")
        return OPTConfig(
            hidden_size=64,
            ffn_dim=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            dropout=0.0,
            **common,
        )
    raise ValueError(arch)


def make_checkpoint(arch: str, out_dir: Path, seed: int = 0, extra_vocab: int = 0) -> Path:
    """Write a float32 random checkpoint of `arch` with the embedded tokenizer; returns its directory.
    `extra_vocab` rows past the tokenizer's make a vocabulary that tensor-parallel ranks must pad."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, len(tok) + extra_vocab)).float()
    if arch == "qwen2":
        # Biases start at zero in HF's init; make them matter so that a dropped bias fails the test.
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = DEFAULT_MODEL_DIR / name
        if src.exists():
            shutil.copy(src, out_dir / name)
    return out_dir
