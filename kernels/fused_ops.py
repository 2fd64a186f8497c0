"""Fused element-wise Triton kernels around attention: RMSNorm (+ residual add), SiLU-mul, rotary.

In eager PyTorch, RMSNorm in float32 is seven kernels (cast, pow, mean, rsqrt, mul, cast, mul) and
SiLU-mul is two over strided halves of the gate/up projection, rotary five (index, cat, neg, mul,
add) per tensor; on an 8B prefill those passes over
memory cost about a fifth of the step (H200 profile, benchmarks/results/throughput-*.json).  Each
function here reads its inputs once and writes its outputs once.

Rounding matches the unfused HF computation step for step: the residual sum is rounded to the
activation dtype before it is normalised, the normalised row is rounded before the weight multiply,
and SiLU is taken in float32 then rounded before the multiply by `up`.  `kernels/reference.py` holds
the torch versions (the CPU path and the oracle of tests/kernels/test_fused_ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.cache_ops import _next_pow2
from kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, pdl_one_row


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if PDL:  # kernels/pdl.py: wait for the kernel before, then let the next (a product) launch
        gdc_wait()
        gdc_launch_dependents()
    # Every read is issued before the first store: a load after the residual store could alias it, so it would
    # wait for the store and the row's sum (one more memory latency, in a kernel of a few microseconds;
    # docs/decisions/decode-small-kernels.md).
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_in,
    stride_out,
    n_cols,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    if PDL:  # kernels/pdl.py
        gdc_wait()
        gdc_launch_dependents()
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    if PDL:  # kernels/pdl.py
        gdc_wait()
        gdc_launch_dependents()
    offs_d = tl.arange(0, HALF_PAD)
    mask_d = offs_d < HALF
    # q and k are read before the position and its cos/sin, and both before either is written: the reads are
    # in flight together (a store to q before k's read would hold that read back, since the two may alias).
    offs_q = tl.arange(0, Q_HEADS_PAD)
    mask_q = (offs_q[:, None] < NUM_Q_HEADS) & mask_d[None, :]
    pq = q_ptr + t * stride_qt + offs_q[:, None] * stride_qh + offs_d[None, :]
    q1 = tl.load(pq, mask=mask_q, other=0.0).to(tl.float32)
    q2 = tl.load(pq + HALF, mask=mask_q, other=0.0).to(tl.float32)
    offs_k = tl.arange(0, K_HEADS_PAD)
    mask_k = (offs_k[:, None] < NUM_K_HEADS) & mask_d[None, :]
    pk = k_ptr + t * stride_kt + offs_k[:, None] * stride_kh + offs_d[None, :]
    k1 = tl.load(pk, mask=mask_k, other=0.0).to(tl.float32)
    k2 = tl.load(pk + HALF, mask=mask_k, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    # cos/sin are rounded to the activation dtype first, as HF does before multiplying
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=mask_d, other=0.0).to(q_ptr.dtype.element_ty)
    s = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=mask_d, other=0.0).to(q_ptr.dtype.element_ty)
    c = c.to(tl.float32)[None, :]
    s = s.to(tl.float32)[None, :]
    tl.store(pq, (q1 * c - q2 * s).to(q_ptr.dtype.element_ty), mask=mask_q)
    tl.store(pq + HALF, (q2 * c + q1 * s).to(q_ptr.dtype.element_ty), mask=mask_q)
    tl.store(pk, (k1 * c - k2 * s).to(k_ptr.dtype.element_ty), mask=mask_k)
    tl.store(pk + HALF, (k2 * c + k1 * s).to(k_ptr.dtype.element_ty), mask=mask_k)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of q ``[T, Hq, D]`` and k ``[T, Hk, D]`` in place (strided views of
    the fused QKV projection are fine); ``cos``/``sin`` are ``[positions, D/2]`` float32 tables."""
    num_tokens, hq, d = q.shape
    hk = k.shape[1]
    if num_tokens and q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1:
        half = d // 2
        on = pdl_one_row(q.device, num_tokens)
        _rotary_kernel[(num_tokens,)](
            q,
            k,
            positions,
            cos,
            sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            NUM_Q_HEADS=hq,
            NUM_K_HEADS=hk,
            Q_HEADS_PAD=_next_pow2(hq),
            K_HEADS_PAD=_next_pow2(hk),
            HALF=half,
            HALF_PAD=_next_pow2(half),
            PDL=on,
            num_warps=4,
            **launch_options(on),
        )
        return q, k
    from kernels import reference

    return reference.rotary(q, k, positions, cos, sin)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, cols] with a unit stride along cols (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of ``x`` (or of ``x + residual``); returns (normed, the new residual or None)."""
    shape = x.shape
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    new_residual = None
    r2, r_out = x2, out  # placeholders when there is no residual (never read or written)
    if residual is not None:
        r2 = _rows(residual)
        new_residual = r_out = torch.empty_like(out)
    if n_rows:
        block = _next_pow2(n_cols)
        on = pdl_one_row(x.device, n_rows)
        _rms_norm_kernel[(n_rows,)](
            x2,
            r2,
            weight,
            out,
            r_out,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            r_out.stride(0),
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            PDL=on,
            num_warps=min(16, max(1, block // 256)),
            **launch_options(on),
        )
    out = out.view(shape)
    return out, (new_residual.view(shape) if new_residual is not None else None)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension."""
    g2 = _rows(gate_up)
    n_rows, width = g2.shape
    n_cols = width // 2
    out = torch.empty((n_rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    if n_rows:
        block = min(1024, _next_pow2(n_cols))
        on = pdl_one_row(gate_up.device, n_rows)
        _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](
            g2,
            out,
            g2.stride(0),
            out.stride(0),
            n_cols,
            BLOCK=block,
            PDL=on,
            num_warps=4,
            **launch_options(on),
        )
    return out.view(*gate_up.shape[:-1], n_cols)


__all__ = ["rms_norm", "silu_mul", "rotary"]
