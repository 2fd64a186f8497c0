"""OPT (facebook/opt-*): learned positions, LayerNorm, ReLU MLP, biases everywhere.

OPT checkpoints come saved either from OPTForCausalLM ("model.decoder.*") or from OPTModel
("decoder.*"); both load.  opt-350m's post-layer-norm variant and its projection between the
embedding width and the hidden width are handled.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from engine.model.layers.attention import AttentionMetadata, PagedAttention
from engine.model.layers.linear import MergedLinear
from engine.model.weights import load_named_weights

_POSITION_OFFSET = 2  # OPT's learned position table starts two rows in


class OPTAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv_proj = MergedLinear(hidden, {"q": hidden, "k": hidden, "v": hidden}, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)
        self.attn = PagedAttention(heads, heads, self.head_dim, self.head_dim**-0.5)
        self._hidden = hidden

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (y.reshape(t, self.heads, self.head_dim) for y in self.qkv_proj(x).split(self._hidden, -1))
        o = self.attn(q, k, v, kv_cache, meta)
        return self.out_proj(o.reshape(t, self._hidden))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        h, bias = cfg.hidden_size, bool(getattr(cfg, "enable_bias", True))
        affine = bool(getattr(cfg, "layer_norm_elementwise_affine", True))
        self.pre_norm = bool(cfg.do_layer_norm_before)
        self.self_attn = OPTAttention(h, cfg.num_attention_heads, bias)
        self.self_attn_layer_norm = nn.LayerNorm(h, elementwise_affine=affine)
        self.fc1 = nn.Linear(h, cfg.ffn_dim, bias=bias)
        self.fc2 = nn.Linear(cfg.ffn_dim, h, bias=bias)
        self.final_layer_norm = nn.LayerNorm(h, elementwise_affine=affine)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.self_attn(h, kv_cache, meta)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self.fc2(torch.relu(self.fc1(h)))
        if not self.pre_norm:
            x = self.final_layer_norm(x)
        return x


class OPTDecoder(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        proj = cfg.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(cfg.vocab_size, proj)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + _POSITION_OFFSET, cfg.hidden_size)
        self.project_in = nn.Linear(proj, cfg.hidden_size, bias=False) if proj != cfg.hidden_size else None
        self.project_out = nn.Linear(cfg.hidden_size, proj, bias=False) if proj != cfg.hidden_size else None
        keep_final = cfg.do_layer_norm_before and not getattr(cfg, "_remove_final_layer_norm", False)
        affine = bool(getattr(cfg, "layer_norm_elementwise_affine", True))
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine) if keep_final else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class OPTInner(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.decoder = OPTDecoder(cfg)


class OPTForCausalLM(nn.Module):
    STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    def __init__(self, hf_config: Any, architecture: str, max_positions: int, device: torch.device | str) -> None:
        super().__init__()
        if getattr(hf_config, "activation_function", "relu") != "relu":
            raise ValueError(f"OPT with activation_function={hf_config.activation_function!r} is not supported")
        self.model = OPTInner(hf_config)
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = hf_config.num_attention_heads
        self.head_dim = hf_config.hidden_size // hf_config.num_attention_heads

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        d = self.model.decoder
        x = d.embed_tokens(input_ids)
        if d.project_in is not None:
            x = d.project_in(x)
        x = x + d.embed_positions(positions + _POSITION_OFFSET)
        for layer, cache in zip(d.layers, kv_caches):
            x = layer(x, cache, meta)
        if d.final_layer_norm is not None:
            x = d.final_layer_norm(x)
        if d.project_out is not None:
            x = d.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.model.decoder.embed_tokens.weight.t()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            if name == "lm_head.weight":
                return None  # OPT ties the output projection to the token embedding
            return name if name.startswith("model.") else "model." + name

        load_named_weights(self, weights, rename, self.STACKED)
