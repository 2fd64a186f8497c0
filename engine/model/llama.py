"""The Llama family: Llama 2/3, Mistral (full attention), Qwen2 (q/k/v bias) and Qwen3 (q/k norm).

These differ only in a few switches read from the HF config, so one implementation serves all of
them.  Module names mirror the HF checkpoints except where matrices are fused (qkv_proj,
gate_up_proj), which the loader fills shard by shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

import kernels
from engine.model.interface import PiecewiseLM
from engine.model.layers.attention import AttentionMetadata, PagedAttention
from engine.model.layers.linear import MergedLinear, RowLinear, VocabEmbedding
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import RotaryEmbedding, rope_settings
from engine.model.overlap import overlaps, two_batch_forward
from engine.model.weights import CheckpointTensor, load_named_weights
from engine.parallel.group import SINGLE, HeadSplit, Part, TPGroup


@dataclass
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict[str, Any]

    @classmethod
    def from_hf(cls, cfg: Any, architecture: str) -> LlamaShape:
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{architecture} with hidden_act={act!r} is not supported (only silu)")
        heads = cfg.num_attention_heads
        theta, scaling = rope_settings(cfg)
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            rope_theta=theta,
            rope_scaling=scaling,
        )


def _rows(heads: Part, head_dim: int) -> Part:
    """A head split as rows of a projection matrix."""
    return Part(heads.full * head_dim, heads.start * head_dim, heads.size * head_dim)


class LlamaAttention(nn.Module):
    """Heads are split over the tensor-parallel ranks (HeadSplit): q/k/v column-parallel, o_proj row-parallel."""

    def __init__(self, s: LlamaShape, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        heads = HeadSplit.of(s.num_heads, s.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, s.head_dim
        q, kv = _rows(heads.q, s.head_dim), _rows(heads.kv, s.head_dim)
        self.qkv_proj = MergedLinear(s.hidden_size, {"q": q, "k": kv, "v": kv}, bias=s.qkv_bias)
        self.o_proj = RowLinear(s.num_heads * s.head_dim, s.hidden_size, bias=s.o_bias, tp=tp)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps) if s.qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps) if s.qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, s.head_dim, s.head_dim**-0.5)
        self._split = (q.size, kv.size, kv.size)

    def project_qkv(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k and v ``[T, Hk, D]``, rotated: everything before the attention itself."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self._split, dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.reshape(o.shape[0], self.num_heads * self.head_dim))

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(positions, x)
        return self.project_out(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, s: LlamaShape, tp: TPGroup) -> None:
        super().__init__()
        i = Part.even(s.intermediate_size, tp, "intermediate_size")
        self.gate_up_proj = MergedLinear(s.hidden_size, {"gate": i, "up": i}, bias=s.mlp_bias)
        self.down_proj = RowLinear(s.intermediate_size, s.hidden_size, bias=s.mlp_bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.fused_backend(x.device).silu_mul(self.gate_up_proj(x)))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the sum over the ranks (engine/model/overlap.py)."""
        return self.down_proj.partial(kernels.fused_backend(x.device).silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, s: LlamaShape, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = LlamaAttention(s, rotary, tp)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = LlamaMLP(s, tp)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the residual add is fused into
        the next norm, so each layer hands both on."""
        q, k, v, residual = self.before_attention(positions, x, residual)
        return self.after_attention(self.self_attn.attn(q, k, v, kv_cache, meta), residual)

    def before_attention(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.add_norm(x, residual)
        return (*self.self_attn.project_qkv(positions, x), residual)

    def after_attention(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.post_attention_layernorm.add_norm(self.self_attn.project_out(o), residual)
        return self.mlp(x), residual


class LlamaInner(nn.Module):
    def __init__(self, s: LlamaShape, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(s.vocab_size, s.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(s, rotary, tp) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def layer(self, index: int) -> LlamaDecoderLayer:
        layer = self.layers[index]
        assert isinstance(layer, LlamaDecoderLayer)
        return layer

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        return [self.layer(i) for i in range(len(self.layers))]


class LlamaForCausalLM(PiecewiseLM):
    """Stacked checkpoint names map onto the fused layers: (fused module, shard) per source name."""

    SPLITS_STEPS = True  # a tensor-parallel step may run as two micro-batches (engine/model/overlap.py)

    STACKED = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(
        self,
        hf_config: Any,
        architecture: str,
        max_positions: int,
        device: torch.device | str,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.shape = s = LlamaShape.from_hf(hf_config, architecture)
        self.rotary = RotaryEmbedding(s.head_dim, max_positions, s.rope_theta, s.rope_scaling, device)
        self.model = LlamaInner(s, self.rotary, tp)
        self.lm_head = None if s.tie_word_embeddings else VocabEmbedding(s.vocab_size, s.hidden_size, tp)
        self.tp = tp
        # KV cache geometry on this rank, read by the runner to size and shape the cache.
        self.num_layers, self.head_dim, self.hidden_size = s.num_layers, s.head_dim, s.hidden_size
        self.num_kv_heads = HeadSplit.of(s.num_heads, s.num_kv_heads, tp).num_kv_heads  # each LlamaAttention's
        # Steps of at least this many tokens run as two micro-batches whose all-reduces overlap (0: never)
        self.overlap_tokens = tp.overlap_tokens if tp.is_parallel else 0
        self.overlapped_steps = 0  # forwards run as two micro-batches (benchmarks and tests read it)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        if overlaps(self.overlap_tokens, input_ids.shape[0], input_ids):
            self.overlapped_steps += 1
            return two_batch_forward(self, input_ids, positions, kv_caches, meta)
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer, cache in zip(self.model.layers, kv_caches):
            x, residual = layer(positions, x, residual, cache, meta)
        return self.model.norm.add_norm(x, residual)[0]

    # The forward in pieces, split at each attention (engine/runner/piecewise.py captures what lies between
    # two attentions as one CUDA graph per token count; `forward` above is the same sequence in one call).
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def before_attention(
        self, layer: int, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v, residual) of layer `layer`, from the previous layer's output and residual (None: the first)."""
        return self.model.layer(layer).before_attention(positions, x, residual)

    def attention(self, layer: int) -> PagedAttention:
        return self.model.layer(layer).self_attn.attn

    def after_attention(self, layer: int, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer output, residual) from the attention's output ``[T, Hq, D]``."""
        return self.model.layer(layer).after_attention(o, residual)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.model.norm.add_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, vocab] on every rank (vocab-parallel shards, gathered)."""
        return (self.model.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]) -> None:
        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name:
                return None
            if name == "lm_head.weight" and self.lm_head is None:
                return None  # tied to the embedding
            return name

        load_named_weights(self, weights, rename, self.STACKED)
