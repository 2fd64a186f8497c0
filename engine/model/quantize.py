"""Write quantized checkpoints from a 16/32-bit one: AutoAWQ GEMM int4, or FP8 (two formats).

    python -m engine.model.quantize awq SRC DST [--group-size 128]
    python -m engine.model.quantize fp8 SRC DST [--format compressed-tensors|fp8]
    python -m engine.model.quantize dequantize-awq SRC DST     # an AWQ checkpoint's weights, as float32

No AWQ checkpoint can be downloaded where pagekeeper is tested, so this writes them: the format is
AutoAWQ's (qweight/qzeros/scales, its packing order and config.json's quantization_config, checked
against casper-hansen/AutoAWQ's awq/modules/linear/gemm.py, awq/utils/packing_utils.py and
awq/models/_config.py; see kernels/quant_reference.py), the values plain round-to-nearest with
AutoAWQ's zero-point convention (per group of `group_size` input features: scale = (max - min) / 15,
zero = round(-min / scale), q = round(w / scale) + zero, all clamped to 0..15).  Real AWQ also
searches activation-aware scales and clipping; that changes the values, not the format, which is
what the engine must read.  Every other tensor is written in float16, as AutoAWQ does.

FP8: `compressed-tensors` writes per-channel scales (`weight_scale` [out, 1]), `fp8` vLLM's
per-tensor format (`weight_scale` a scalar); activations are left dynamic in both.

The linear layers quantized are the 2-D weights of the decoder layers' projections (q/k/v/o,
gate/up/down; OPT's q/k/v/out_proj and fc1/fc2): what AutoAWQ and llm-compressor quantize for
these architectures.  Embeddings, norms and the LM head stay as they are.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.quant_reference import awq_dequantize, pack_int4, quantize_rows

_LINEAR = re.compile(r"\.layers\.\d+\.(.*\.)?(\w+_proj|fc1|fc2)\.weight$")
FP8 = torch.float8_e4m3fn


def is_quantized_linear(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and bool(_LINEAR.search(name))


def awq_quantize(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """One nn.Linear weight ``[out, in]`` as AutoAWQ GEMM tensors (round to nearest, zero points)."""
    out_f, in_f = w.shape
    if in_f % group_size or out_f % 8:
        raise ValueError(f"a {out_f} x {in_f} weight does not split into groups of {group_size} and words of 8")
    groups = w.float().reshape(out_f, in_f // group_size, group_size)
    hi, lo = groups.amax(dim=-1), groups.amin(dim=-1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()  # the stored scales; q is computed with them
    s = scales.float()
    zeros = (-torch.round(lo / s)).clamp(0, 15)
    q = (torch.round(groups / s[..., None]) + zeros[..., None]).clamp(0, 15).reshape(out_f, in_f)
    return {
        "qweight": pack_int4(q.t().contiguous().to(torch.int32)),  # [in, out / 8]
        "qzeros": pack_int4(zeros.t().contiguous().to(torch.int32)),  # [in / g, out / 8]
        "scales": scales.t().contiguous(),  # [in / g, out] float16
    }


def _read(src: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    if not tensors:
        raise SystemExit(f"error: no *.safetensors in {src}")
    return tensors


def _copy_side_files(src: Path, dst: Path) -> dict:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    return json.loads((src / "config.json").read_text())


def _write(dst: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"}
    )


def write_awq(src: Path, dst: Path, group_size: int = 128) -> Path:
    """An AutoAWQ GEMM checkpoint of `src` in `dst` (tokenizer files copied); returns `dst`."""
    config = _copy_side_files(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, t in _read(src).items():
        if is_quantized_linear(name, t):
            prefix = name.removesuffix(".weight")
            for leaf, value in awq_quantize(t, group_size).items():
                out[f"{prefix}.{leaf}"] = value
        else:
            out[name] = t.half() if t.is_floating_point() else t
    config["quantization_config"] = {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group_size,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    config["torch_dtype"] = "float16"
    config.pop("dtype", None)
    _write(dst, config, out)
    return dst


def write_fp8(src: Path, dst: Path, fmt: str = "compressed-tensors") -> Path:
    """An FP8 checkpoint: per-channel scales (compressed-tensors) or per-tensor ones (vLLM's fp8)."""
    config = _copy_side_files(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, t in _read(src).items():
        if not is_quantized_linear(name, t):
            out[name] = t
            continue
        prefix = name.removesuffix(".weight")
        if fmt == "fp8":
            scale = (t.float().abs().amax().clamp(min=1e-12) / 448).reshape(())
            out[name] = (t.float() / scale).clamp(-448, 448).to(FP8)
            out[f"{prefix}.weight_scale"] = scale
        else:
            q, s = quantize_rows(t)
            out[name] = q
            out[f"{prefix}.weight_scale"] = s[:, None]
    if fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    else:
        scheme = {"num_bits": 8, "type": "float", "symmetric": True}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {**scheme, "strategy": "channel", "dynamic": False},
                    "input_activations": {**scheme, "strategy": "token", "dynamic": True},
                }
            },
            "ignore": ["lm_head"],
        }
    _write(dst, config, out)
    return dst


def dequantize_awq(src: Path, dst: Path) -> Path:
    """The float32 checkpoint whose weights are exactly an AWQ checkpoint's dequantized ones (the
    oracle the AWQ tests compare against)."""
    config = _copy_side_files(src, dst)
    group = int(config["quantization_config"]["group_size"])
    tensors = _read(src)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            prefix = name.removesuffix(".qweight")
            w = awq_dequantize(t, tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"], group)
            out[f"{prefix}.weight"] = w.t().contiguous()
        elif not name.endswith((".qzeros", ".scales")):
            out[name] = t.float() if t.is_floating_point() else t
    del config["quantization_config"]
    config["torch_dtype"] = "float32"
    _write(dst, config, out)
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.model.quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("method", choices=("awq", "fp8", "dequantize-awq"))
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--group-size", type=int, default=128, help="AWQ: input features per group (default 128).")
    parser.add_argument("--format", default="compressed-tensors", choices=("compressed-tensors", "fp8"))
    args = parser.parse_args(argv)
    if not (args.src / "config.json").exists():
        print(f"error: {args.src} has no config.json", file=sys.stderr)
        return 2
    try:
        if args.method == "awq":
            write_awq(args.src, args.dst, args.group_size)
        elif args.method == "fp8":
            write_fp8(args.src, args.dst, args.format)
        else:
            dequantize_awq(args.src, args.dst)
    except (ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
