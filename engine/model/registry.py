"""Which HF architectures pagekeeper implements, and the class that implements each."""

from __future__ import annotations

from engine.model.interface import CausalLM
from engine.model.llama import LlamaForCausalLM
from engine.model.opt import OPTForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
}


def supported() -> str:
    return ", ".join(sorted(ARCHITECTURES))
