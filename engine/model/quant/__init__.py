"""Weight quantization: what a checkpoint asks for (spec.py), the quantized linear layers (layers.py)
and their two storage schemes (fp8.py, awq.py).  The FP8 KV cache is not here: it lives with the
cache (kernels/, engine/runner/kv_scales.py)."""

from engine.model.quant.spec import QuantSpec, check_device, check_dtype, resolve_quantization

__all__ = ["QuantSpec", "check_device", "check_dtype", "resolve_quantization"]
