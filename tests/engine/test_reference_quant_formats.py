"""Quantized checkpoints written by each format's own reference tool, not by engine/model/quantize.py.

- compressed-tensors FP8 (what llm-compressor's FP8_DYNAMIC recipe saves): the library's own
  apply_quantization_config, calculate_qparams and ModelCompressor ("float-quantized") write the checkpoint;
  the reference is transformers loading it through compressed-tensors, whose decompressor dequantizes the
  weights (weight x weight_scale) and whose forward quantizes each Linear's input per token
  (`input_activations: dynamic, token`), as the engine does.
- AutoAWQ GEMM: AutoAWQ's own AwqQuantizer._apply_quant (pseudo_quantize_tensor, then
  WQLinear_GEMM.from_linear, which packs), saved as AwqBaseForCausalLM.save_quantized saves; the reference
  is the float model whose Linear weights are AutoAWQ's dequantize_gemm of the packed tensors.  The
  activation-aware scale search needs calibration text and changes the weights' values, not the format.

Each engine (float32, CPU) must match its reference within 1e-3 of the largest logit, over one prefill and
over decode steps that read the paged cache, and produce the same greedy tokens.  The packages are in the
test extra; a test skips where one is missing, except in CI (CI=true), where it fails.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors import safe_open

from engine import LLM
from tests.checkpoints import TOKENIZER_FILES, make_checkpoint
from tests.engine.logits_probe import engine_logits, greedy

MAX_REL_LOGIT_DIFF = 1e-3
AWQ_GROUP = 32
IDS = [(7 * i + 3) % 300 for i in range(90)]
PROMPTS = [IDS[:5], IDS[20:31], IDS[50:53]]
NEW_TOKENS = 16


def _require(module: str) -> ModuleType:
    """Import `module`; skip where it is not installed, except in CI (scripts/setup.sh --test installs it)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        message = f"{module} is not installed ({e}); scripts/setup.sh --test installs it (the test extra)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def _check_logits(llm: LLM, reference: torch.nn.Module, label: str) -> None:
    with torch.no_grad():
        want = reference(torch.tensor([IDS])).logits[0].float()
    for n, chunk in ((90, 90), (24, 1)):  # one prefill; decode steps over cached tokens
        got = engine_logits(llm, IDS[:n], chunk)
        diff = float((got - want[:n]).abs().max())
        top = float(want[:n].abs().max())
        print(f"{label}, chunk {chunk}: max |logit difference| {diff:.2e}, largest |logit| {top:.3f}")
        assert diff <= MAX_REL_LOGIT_DIFF * top


def _check_greedy(llm: LLM, reference: Any) -> None:
    ours = greedy(llm, [{"prompt_token_ids": p} for p in PROMPTS], NEW_TOKENS)
    theirs = []
    with torch.no_grad():
        for p in PROMPTS:
            out = reference.generate(
                torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0
            )
            theirs.append(out[0, len(p) :].tolist())
    assert ours == theirs


@pytest.fixture(scope="module")
def compressed_tensors_fp8(tmp_path_factory) -> Path:
    """A random Llama quantized to FP8 by compressed-tensors itself, saved as llm-compressor saves it."""
    _require("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import FP8_DYNAMIC
    from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("ct-fp8")
    src = make_checkpoint("llama", root / "src", seed=3)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    scheme = QuantizationScheme(targets=["Linear"], **FP8_DYNAMIC)  # per-channel static weights, per-token inputs
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    quantized = [m for m in model.modules() if is_module_quantized(m)]
    assert len(quantized) == 14  # 7 Linear layers in each of 2 decoder layers
    for m in quantized:  # the weight observer's step (llm-compressor's calibration): min/max per output row
        w = m.weight.data
        scale, _ = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), scheme.weights)
        m.weight_scale.data.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    out = root / "fp8"
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    _copy_tokenizer(src, out)
    return out


@pytest.fixture(scope="module")
def autoawq_gemm(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """(A random Llama quantized and packed by AutoAWQ itself, the float32 model of its dequantized weights)."""
    _require("awq")
    from awq.models._config import AwqConfig
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.module import get_named_linears
    from awq.utils.packing_utils import dequantize_gemm
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("autoawq")
    src = make_checkpoint("llama", root / "src", seed=4)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float16)
    # AwqQuantizer's constructor runs the calibration; _apply_quant (round to nearest with zero points, then
    # WQLinear_GEMM.from_linear) reads only these four fields.
    quantizer = object.__new__(AwqQuantizer)
    quantizer.w_bit, quantizer.group_size, quantizer.zero_point, quantizer.version = 4, AWQ_GROUP, True, "gemm"
    for layer in model.model.layers:
        quantizer._apply_quant(layer, get_named_linears(layer))
    out = root / "awq"
    # AwqBaseForCausalLM.save_quantized: config.json with its quantization_config, then the state dict
    model.config.quantization_config = AwqConfig(q_group_size=AWQ_GROUP, version="gemm").to_transformers_dict()
    model.save_pretrained(str(out), state_dict={})
    (out / "model.safetensors").unlink(missing_ok=True)
    save_torch_state_dict(state_dict=model.state_dict(), save_directory=str(out), force_contiguous=True)
    _copy_tokenizer(src, out)

    reference = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float16).float()
    for plain, packed in zip(reference.model.layers, model.model.layers):
        qlayers = dict(packed.named_modules())
        for name, linear in get_named_linears(plain).items():
            q = qlayers[name]
            # float32 scales: (q - z) * s exactly, where float16 scales would round each product to float16
            w = dequantize_gemm(q.qweight, q.qzeros, q.scales.float(), 4, AWQ_GROUP)
            linear.weight.data = w.t().contiguous()
    return out, reference.eval()


def test_compressed_tensors_fp8_checkpoint_matches_the_reference(compressed_tensors_fp8):
    from transformers import AutoModelForCausalLM

    path = compressed_tensors_fp8
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        prefix = "model.layers.1.mlp.down_proj"
        assert f.get_slice(f"{prefix}.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice(f"{prefix}.weight_scale").get_shape() == [64, 1]
    llm = LLM(str(path), dtype="float32", max_model_len=128)
    spec = llm.llm_engine.core.model_info.quant
    assert (spec.method, spec.fmt) == ("fp8", "compressed-tensors")
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert reference.model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn  # still compressed
    _check_logits(llm, reference, "compressed-tensors FP8")
    _check_greedy(llm, reference)


def test_autoawq_gemm_checkpoint_matches_the_reference(autoawq_gemm):
    path, reference = autoawq_gemm
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc == {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": AWQ_GROUP,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    llm = LLM(str(path), dtype="float32", max_model_len=128)
    spec = llm.llm_engine.core.model_info.quant
    assert (spec.method, spec.group_size) == ("awq", AWQ_GROUP)
    _check_logits(llm, reference, f"AutoAWQ GEMM g{AWQ_GROUP}")
    _check_greedy(llm, reference)
