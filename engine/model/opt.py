"""OPT (facebook/opt-*): learned positions, LayerNorm, ReLU MLP, biases everywhere.

OPT checkpoints come saved either from OPTForCausalLM ("model.decoder.*") or from OPTModel
("decoder.*"); both load.  opt-350m's post-layer-norm variant and its projection between the
embedding width and the hidden width are handled.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from engine.model.interface import CausalLM
from engine.model.layers.attention import AttentionMetadata, PagedAttention
from engine.model.layers.linear import ColumnLinear, MergedLinear, RowLinear, VocabEmbedding
from engine.model.weights import CheckpointTensor, load_named_weights
from engine.parallel.group import SINGLE, HeadSplit, Part, TPGroup

_POSITION_OFFSET = 2  # OPT's learned position table starts two rows in


class OPTAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.heads = HeadSplit.of(heads, heads, tp).num_heads
        d = self.head_dim
        rows = Part(hidden, tp.rank * self.heads * d, self.heads * d)
        self.qkv_proj = MergedLinear(hidden, {"q": rows, "k": rows, "v": rows}, bias=bias)
        self.out_proj = RowLinear(hidden, hidden, bias=bias, tp=tp)
        self.attn = PagedAttention(self.heads, self.heads, d, d**-0.5)
        self._local = rows.size

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (y.reshape(t, self.heads, self.head_dim) for y in self.qkv_proj(x).split(self._local, -1))
        o = self.attn(q, k, v, kv_cache, meta)
        return self.out_proj(o.reshape(t, self._local))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup) -> None:
        super().__init__()
        h, bias = cfg.hidden_size, bool(getattr(cfg, "enable_bias", True))
        affine = bool(getattr(cfg, "layer_norm_elementwise_affine", True))
        self.pre_norm = bool(cfg.do_layer_norm_before)
        self.self_attn = OPTAttention(h, cfg.num_attention_heads, bias, tp)
        self.self_attn_layer_norm = nn.LayerNorm(h, elementwise_affine=affine)
        self.fc1 = ColumnLinear(h, Part.even(cfg.ffn_dim, tp, "ffn_dim"), bias=bias)
        self.fc2 = RowLinear(cfg.ffn_dim, h, bias=bias, tp=tp)
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
    def __init__(self, cfg: Any, tp: TPGroup) -> None:
        super().__init__()
        proj = cfg.word_embed_proj_dim
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, proj, tp)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + _POSITION_OFFSET, cfg.hidden_size)
        self.project_in = nn.Linear(proj, cfg.hidden_size, bias=False) if proj != cfg.hidden_size else None
        self.project_out = nn.Linear(cfg.hidden_size, proj, bias=False) if proj != cfg.hidden_size else None
        keep_final = cfg.do_layer_norm_before and not getattr(cfg, "_remove_final_layer_norm", False)
        affine = bool(getattr(cfg, "layer_norm_elementwise_affine", True))
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine) if keep_final else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers))


class OPTInner(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup) -> None:
        super().__init__()
        self.decoder = OPTDecoder(cfg, tp)


class OPTForCausalLM(CausalLM):
    STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    def __init__(
        self,
        hf_config: Any,
        architecture: str,
        max_positions: int,
        device: torch.device | str,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        if getattr(hf_config, "activation_function", "relu") != "relu":
            raise ValueError(f"OPT with activation_function={hf_config.activation_function!r} is not supported")
        self.model = OPTInner(hf_config, tp)
        self.num_layers = hf_config.num_hidden_layers
        heads = hf_config.num_attention_heads
        self.num_kv_heads = HeadSplit.of(heads, heads, tp).num_heads  # each layer's OPTAttention.heads
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
        return self.model.decoder.embed_tokens.logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]) -> None:
        def rename(name: str) -> str | None:
            if name == "lm_head.weight":
                return None  # OPT ties the output projection to the token embedding
            return name if name.startswith("model.") else "model." + name

        load_named_weights(self, weights, rename, self.STACKED)
