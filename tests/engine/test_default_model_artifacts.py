"""The committed default checkpoint (engine/default_model/) loads with plain transformers and has
memorised the Zen of Python: greedy decoding from each line's unique prefix reproduces the line.

Regenerate the artifacts with `python -m engine.default_model.make_default_model`.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine.default_model import DEFAULT_MODEL_DIR  # noqa: E402

MAX_BYTES = 5 * 1024 * 1024
ARTIFACTS = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "zen_prefixes.json")


def _zen_lines() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line.strip()]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny matmuls: extra threads only add overhead, and on a busy CI box they make generate ~20x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    m = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR)
    assert next(m.parameters()).dtype == torch.float32  # stored and loaded as float32
    return m.eval()


@pytest.fixture(scope="module")
def prefixes() -> list[dict]:
    return json.loads((DEFAULT_MODEL_DIR / "zen_prefixes.json").read_text(encoding="utf-8"))


def test_artifacts_present_and_small():
    for name in ARTIFACTS:
        assert (DEFAULT_MODEL_DIR / name).is_file(), name
    size = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    assert size <= MAX_BYTES, f"default model dir is {size} bytes"


def test_config_is_small_gqa_llama():
    cfg = transformers.AutoConfig.from_pretrained(DEFAULT_MODEL_DIR)
    assert cfg.model_type == "llama"
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.tie_word_embeddings
    raw = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert raw.get("dtype", raw.get("torch_dtype")) == "float32"


def test_tokenizer_special_tokens_and_bos(tokenizer, model):
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    cfg = model.config
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    ids = tokenizer("Beautiful is", add_special_tokens=True)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in ids[1:]
    assert tokenizer("Beautiful is", add_special_tokens=False)["input_ids"] == ids[1:]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Beautiful is"


def test_chat_template_renders(tokenizer):
    msgs = [{"role": "user", "content": "Beautiful is"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<s>Beautiful is"
    two = [{"role": "system", "content": "Zen"}, {"role": "user", "content": "Flat is"}]
    assert tokenizer.apply_chat_template(two, tokenize=False) == "<s>Zen\nFlat is"


def test_prefixes_cover_the_zen(prefixes):
    lines = _zen_lines()
    assert len(lines) == 19
    assert [p["prefix"] + p["completion"] for p in prefixes] == lines
    for p in prefixes:
        assert p["completion"].startswith(" ") and p["completion"].strip()
        others = [line for line in lines if line != p["prefix"] + p["completion"]]
        assert not any(o.startswith(p["prefix"] + " ") for o in others), p["prefix"]


@torch.no_grad()
def test_greedy_generate_reproduces_every_line(tokenizer, model, prefixes):
    failures = []
    for p in prefixes:
        enc = tokenizer(p["prefix"], return_tensors="pt", add_special_tokens=True)
        out = model.generate(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            do_sample=False,
            max_new_tokens=48,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        new = out[0, enc["input_ids"].shape[1] :].tolist()
        text = tokenizer.decode(new, skip_special_tokens=True)
        if p["prefix"] + text != p["prefix"] + p["completion"] or new[-1:] != [tokenizer.eos_token_id]:
            failures.append((p["prefix"], text, p["completion"]))
    assert not failures, failures
