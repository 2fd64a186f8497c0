"""AWQ int4 checkpoints: written by engine/model/quantize.py in AutoAWQ's GEMM format, loaded and served.

Must-show: a checkpoint made by the quantizer loads, and its logits equal (within 1e-3, float32) those
of a plain model whose weights are its dequantized weights: the packing order, the zero points, the
group scales and every tensor-parallel slice are read exactly as written.  The quantization error
itself (round to nearest, int4) is reported on the embedded model.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open

from engine import LLM
from engine.default_model import DEFAULT_MODEL_DIR
from engine.model.quantize import dequantize_awq, write_awq
from kernels.quant_reference import awq_dequantize
from tests.engine.logits_probe import agreement, engine_logits, greedy, logit_error, zen_prefixes, zen_text
from tests.server.harness import REPO, free_port

MAX_LOGIT_DIFF = 1e-3


@pytest.fixture(scope="module")
def awq(tmp_path_factory, checkpoint):
    """awq(name, group) -> (AWQ checkpoint, its dequantized float32 twin); name "zen" is the embedded model."""
    made: dict[tuple[str, int], tuple[Path, Path]] = {}

    def get(name: str, group: int) -> tuple[Path, Path]:
        if (name, group) not in made:
            src = DEFAULT_MODEL_DIR if name == "zen" else checkpoint(name)
            root = tmp_path_factory.mktemp(f"awq-{name}-{group}")
            q = write_awq(src, root / "awq", group)
            made[(name, group)] = (q, dequantize_awq(q, root / "dequantized"))
        return made[(name, group)]

    return get


@pytest.mark.parametrize("name,group", [("zen", 128), ("llama", 32), ("qwen2", 32), ("opt", 32)])
def test_awq_logits_equal_the_dequantized_model(awq, name, group):
    """Llama (GQA), Qwen2 (q/k/v biases, kept float16 by the quantizer), OPT (fc1/fc2, out_proj)."""
    q, deq = awq(name, group)
    ours, theirs = LLM(str(q), dtype="float32", max_model_len=128), LLM(str(deq), max_model_len=128)
    assert ours.llm_engine.core.model_info.quant.method == "awq"
    ids = [(7 * i + 3) % 300 for i in range(90)]
    for n, chunk in ((24, 1), (90, 90)):  # decode steps over cached tokens; one prefill
        a, b = engine_logits(ours, ids[:n], chunk), engine_logits(theirs, ids[:n], chunk)
        diff = float((a - b).abs().max())
        print(
            f"AWQ {name} g{group} chunk {chunk}: max |logit difference| {diff:.2e} (logits up to {b.abs().max():.1f})"
        )
        assert diff <= MAX_LOGIT_DIFF


def test_quantizer_writes_autoawqs_gemm_format(awq):
    """config.json's quantization_config as AutoAWQ's to_transformers_dict writes it; per linear layer
    qweight I32 [in, out/8], qzeros I32 [in/g, out/8], scales F16 [in/g, out] and no float weight;
    round to nearest: every weight within half a step of its group's grid."""
    q, _ = awq("zen", 128)
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": 128,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    assert cfg["torch_dtype"] == "float16"
    with (
        safe_open(str(q / "model.safetensors"), "pt") as f,
        safe_open(str(DEFAULT_MODEL_DIR / "model.safetensors"), "pt") as orig,
    ):
        names = set(f.keys())
        assert "model.layers.0.mlp.down_proj.weight" not in names
        prefix = "model.layers.2.mlp.down_proj"  # [128 out, 384 in]: 3 groups
        shapes = {
            leaf: (f.get_slice(f"{prefix}.{leaf}").get_shape(), f.get_slice(f"{prefix}.{leaf}").get_dtype())
            for leaf in ("qweight", "qzeros", "scales")
        }
        assert shapes == {"qweight": ([384, 16], "I32"), "qzeros": ([3, 16], "I32"), "scales": ([3, 128], "F16")}
        w = orig.get_tensor(f"{prefix}.weight").float()
        t = {leaf: f.get_tensor(f"{prefix}.{leaf}") for leaf in ("qweight", "qzeros", "scales")}
    back = awq_dequantize(t["qweight"], t["qzeros"], t["scales"], 128).t()
    step = t["scales"].float().repeat_interleave(128, dim=0).t()
    worst = float(((back - w).abs() / step).max())
    # Half a step, plus a hair where the group's maximum meets the clamp at 15: the step is rounded to
    # float16 before the values are, so (max - min) / step can exceed 15 by a rounding.
    print(f"AWQ round to nearest: worst error {worst:.4f} of a step")
    assert worst <= 0.51


def test_awq_on_the_embedded_model_in_float16(awq):
    """The seed's set-up (--quantization awq --dtype half): tokens against the float32 model whose weights
    are the dequantized ones (the kernels' and float16's error) and against the original model (plus
    int4 round to nearest).  Weight memory shrinks to the packed tensors."""
    q, deq = awq("zen", 128)
    half = LLM(str(q), quantization="awq", dtype="half")
    core = half.llm_engine.core
    assert core.model_info.dtype == torch.float16 and LLM(str(q)).llm_engine.core.model_info.dtype == torch.float16
    dequantized, original = LLM(str(deq)), LLM(None)
    ids = original.get_tokenizer()(zen_text())["input_ids"][:200]
    err = logit_error(engine_logits(half, ids, 200), engine_logits(dequantized, ids, 200))
    prompts = zen_prefixes()
    tokens = greedy(half, prompts)
    vs_deq, vs_orig = agreement(tokens, greedy(dequantized, prompts)), agreement(tokens, greedy(original, prompts))
    by_dtype = core.kv_plan.weights_by_dtype
    print(
        f"AWQ float16 vs dequantized float32: logits {err}; greedy {vs_deq[0]:.3f} ({vs_deq[1]}/19 identical); "
        f"vs the original model {vs_orig[0]:.3f} ({vs_orig[1]}/19); weights {by_dtype}"
    )
    assert err["max_rel"] < 0.01 and vs_deq[0] >= 0.9
    assert set(by_dtype) == {"float16", "int32"}


@pytest.mark.slow
def test_awq_tensor_parallel_two_ranks_equals_one(awq):
    """Packed columns split per rank on whole int32 words, input rows on whole groups (g=64: the
    embedded model's 384 MLP features split into 3 groups per rank)."""
    q, _ = awq("zen", 64)
    prompts = zen_prefixes()[:8]
    with LLM(str(q), dtype="float32") as one, LLM(str(q), dtype="float32", tensor_parallel_size=2) as two:
        a, b = greedy(one, prompts), greedy(two, prompts)
    print(f"AWQ g64 TP=2 vs TP=1: {agreement(b, a)}")
    assert a == b


def test_a_tensor_parallel_size_that_splits_a_group_is_refused_naming_the_sizes_that_work(awq):
    from engine.config import ConfigError

    q, _ = awq("zen", 128)
    with pytest.raises(ConfigError) as e:
        LLM(str(q), tensor_parallel_size=2)
    print(f"refused: {e.value}")
    assert "\n" not in str(e.value) and "groups of 128" in str(e.value) and "sizes that split it" in str(e.value)


@pytest.mark.slow
def test_the_seeds_awq_start_up_line_serves(awq, tmp_path):
    """`python -m engine.server --model DIR --quantization awq --dtype half` serves completions (on this
    CPU: the torch path; on a GPU the same line runs the Triton kernel)."""
    q, _ = awq("zen", 128)
    port = free_port()
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.server",
            "--model",
            str(q),
            "--quantization",
            "awq",
            "--dtype",
            "half",
            "--port",
            str(port),
        ],
        cwd=str(REPO),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"model": "awq", "prompt": "Beautiful is", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        print(f"served: {r.status_code} {r.json()['choices'][0]['text']!r}")
        assert r.status_code == 200 and r.json()["choices"][0]["text"].strip()
        assert "awq int4" in (tmp_path / "server.log").read_text()
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@pytest.mark.slow
def test_the_memory_estimate_shows_what_quantization_buys(awq, tmp_path):
    """opsctl doctor's figures (engine/memory/estimate.py): weights per storage dtype beside the unquantized
    size, KV bytes per token in the cache's dtype beside the other --kv-cache-dtype."""
    from engine.config import EngineConfig
    from engine.memory.estimate import estimate

    q, _ = awq("zen", 128)
    plain = estimate(EngineConfig(model=str(DEFAULT_MODEL_DIR), dtype="float16", kv_cache_memory_bytes=1 << 24))
    quant = estimate(EngineConfig(model=str(q), kv_cache_dtype="fp8", kv_cache_memory_bytes=1 << 24))
    r = quant.ranks[0]
    print(
        f"estimate: weights {r.weight_bytes_by_dtype} vs {r.unquantized_weight_bytes} unquantized; KV/token "
        f"{quant.kv_bytes_per_token} ({quant.kv_dtype}) vs {quant.kv_bytes_per_token_other}; tokens "
        f"{quant.kv_tokens} vs {plain.kv_tokens}"
    )
    assert set(r.weight_bytes_by_dtype) == {"int32", "float16"} and r.unquantized_weight_bytes == plain.weight_bytes
    assert r.weight_bytes < plain.weight_bytes / 3  # the embedded model: 3.3x (its embedding is 16-bit)
    assert quant.kv_dtype == "float8_e4m3fn" and quant.kv_bytes_per_token * 2 == plain.kv_bytes_per_token
    assert quant.kv_bytes_per_token_other == plain.kv_bytes_per_token and quant.kv_tokens == 2 * plain.kv_tokens
    cfg = tmp_path / "doctor.toml"
    cfg.write_text(
        f'[engine]\nmodel = "{q}"\nkv_cache_dtype = "fp8"\nport = 1\n[supervisor]\nruntime_dir = "{tmp_path / "run"}"\n'
    )
    doctor = subprocess.run(
        [sys.executable, "-m", "opsctl.cli", "--config", str(cfg), "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
    )
    lines = [ln for ln in doctor.stdout.splitlines() if "weights" in ln or "kv per token" in ln]
    print("\n".join(lines))
    assert any("int32" in ln and "unquantized" in ln for ln in lines), doctor.stdout
    assert any("in float8_e4m3fn" in ln and "with --kv-cache-dtype auto" in ln for ln in lines), doctor.stdout
