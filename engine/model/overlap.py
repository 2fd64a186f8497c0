"""A tensor-parallel step as two micro-batches: one's all-reduces run while the other's matrix products do.

Every layer of a tensor-parallel Llama sums its partial outputs over the ranks twice (after the attention's
output projection and after the MLP), and the GPUs compute nothing while they wait for it: on 4 H200s the
70B shape's all-reduces were about a third of the serial bound (issue 36).  Only the attention mixes a
sequence's tokens; every other operation is row by row.  So a large step's token rows are cut in two halves
A and B, the attention still runs over all of them at once (its metadata is the step's), and everything
between two attentions is issued half by half:

    o_proj(A) -> sum A | o_proj(B) -> sum B | wait A: norm, MLP(A) -> sum A | wait B: norm, MLP(B) -> sum B |
    wait A: norm, QKV(A) | wait B: norm, QKV(B) | attention over A+B

so that each half's all-reduce (NCCL's own stream on CUDA, gloo's thread on the CPU) runs under the other
half's GEMMs.  Each row goes through exactly the operations of the plain forward, in the same order; a GEMM
over half the rows may pick another kernel than over all of them, so float32 agrees with the plain forward
to rounding (the tests compare greedy tokens and logits), not bit for bit.

It pays where the GEMMs are compute-bound (a few hundred rows per half and more): below that each half reads
every weight again, which costs more than the all-reduce it hides.  Steps inside a CUDA graph never split
(a decode graph of a few hundred rows is bandwidth-bound anyway, and the piecewise graphs of steps up to
1,024 tokens capture the plain layers), so on CUDA only the eager steps above the largest piece graph do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from engine.model.layers.attention import AttentionMetadata
from engine.parallel.group import Reduction

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM

ROW_ALIGN = 16  # the cut between the halves: a multiple of this many rows (aligned GEMM tiles and addresses)


def set_overlap_tokens(model: torch.nn.Module, tokens: int) -> None:
    """Change a tensor-parallel model's threshold (0: off) between steps; ValueError for a model that cannot
    split (the Llama family can) or a threshold no step could be split at."""
    from engine.model.llama import LlamaForCausalLM  # which imports this module

    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"{type(model).__name__} does not split its steps into micro-batches")
    if tokens < 0 or tokens == 1:
        raise ValueError(f"the overlap threshold must be 0 (off) or >= 2 tokens, got {tokens}")
    model.overlap_tokens = tokens if model.tp.is_parallel else 0


def overlaps(min_tokens: int, num_tokens: int, x: torch.Tensor) -> bool:
    """Whether a step of `num_tokens` rows runs as two micro-batches: the switch is on, the step is large enough
    and not being captured into a CUDA graph (an all-reduce that the graph's stream does not wait for inline)."""
    if min_tokens <= 0 or num_tokens < max(min_tokens, 2):
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def split_point(num_tokens: int) -> int:
    """Where half A ends: half the rows, rounded down to ROW_ALIGN when both halves keep rows."""
    half = num_tokens // 2
    aligned = half - half % ROW_ALIGN
    return aligned if aligned > 0 else max(1, half)


def two_batch_forward(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[torch.Tensor],
    meta: AttentionMetadata,
) -> torch.Tensor:
    """The model's final hidden states ``[T, hidden]`` (as `LlamaForCausalLM.forward`), computed as two halves."""
    tp, inner = model.tp, model.model
    num_tokens = input_ids.shape[0]
    cut = split_point(num_tokens)
    halves = (slice(0, cut), slice(cut, num_tokens))
    embed = inner.embed_tokens
    # What each half waits for before its next norm: a sum in flight and the layer that adds its bias.
    pending: list[Reduction] = [tp.start_all_reduce(embed.partial(input_ids[h])) for h in halves]
    add_bias: list[Callable[[torch.Tensor], torch.Tensor]] = [_identity, _identity]
    residual: list[torch.Tensor | None] = [None, None]
    for layer, cache in zip(inner.decoder_layers(), kv_caches):
        attn = layer.self_attn
        parts = []
        for j, rows in enumerate(halves):
            x = add_bias[j](pending[j].wait())
            q, k, v, residual[j] = layer.before_attention(positions[rows], x, residual[j])
            parts.append((q, k, v))
        q, k, v = joined(parts, num_tokens)
        del parts  # each tensor goes as soon as it is used: the start-up profile measured the plain forward's peak
        o = attn.attn(q, k, v, cache, meta).reshape(num_tokens, attn.num_heads * attn.head_dim)
        del q, k, v
        summed = [tp.start_all_reduce(attn.o_proj.partial(o[rows])) for rows in halves]
        del o
        for j in range(2):
            y = attn.o_proj.finish(summed[j].wait())
            x, residual[j] = layer.post_attention_layernorm.add_norm(y, residual[j])
            pending[j] = tp.start_all_reduce(layer.mlp.partial(x))
            add_bias[j] = layer.mlp.down_proj.finish
    hidden = []
    for j in range(2):
        residual_j = residual[j]
        assert residual_j is not None
        hidden.append(inner.norm.add_norm(add_bias[j](pending[j].wait()), residual_j)[0])
    return torch.cat(hidden)


def joined(
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The halves' q ``[n, Hq, D]``, k and v ``[n, Hk, D]`` as the whole step's, laid out as the plain forward
    lays them out: views of one ``[T, (Hq + 2 Hk) D]`` tensor, as the fused QKV projection writes it (the layout
    the attention kernels, and cuDNN's plans for fresh chunks, were set up for)."""
    q0, k0, _ = parts[0]
    hq, hk, d = q0.shape[1], k0.shape[1], q0.shape[2]
    qkv = torch.empty(num_tokens, (hq + 2 * hk) * d, dtype=q0.dtype, device=q0.device)
    q = qkv[:, : hq * d].unflatten(1, (hq, d))
    k = qkv[:, hq * d : (hq + hk) * d].unflatten(1, (hk, d))
    v = qkv[:, (hq + hk) * d :].unflatten(1, (hk, d))
    row = 0
    for part in parts:
        n = part[0].shape[0]
        for whole, half in zip((q, k, v), part):
            whole[row : row + n].copy_(half)
        row += n
    return q, k, v


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x
