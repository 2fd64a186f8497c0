"""Triton: a decode step's product with FP8 weights, ``x @ (w x scale)^T`` for up to 16 rows, built to read the
e4m3 weight ``[N, K]`` once at close to copy bandwidth.

A decode GEMV does two multiply-adds per weight byte and row: the weight read is what should bound it, so the
kernels are shaped for bytes in flight, not for arithmetic.  Three kernels, by row count:

- `_fp8_gemv_stream_kernel`, on the CUDA cores, for one row (where K is whole ``BLOCK_K`` steps): a grid of
  ``CTAS`` programs per SM (not one per tile), each taking every grid-th tile of ``BLOCK_N`` weight rows and
  running one loop over all its (tile, K step) pairs, so that Triton's software pipeline (``STAGES`` deep, the
  tiles copied to shared memory asynchronously; with ``TMA`` by the bulk tensor-copy engine from a descriptor)
  keeps loading across the tiles' boundaries; each tile's sum is stored after its last step, with no K splits.
  The pipeline keeps several tiles in flight per program at a few dozen registers a thread, where the register
  double buffer below holds one (docs/decisions/quant-paths.md, "The one-row FP8 product as a pipelined stream");
- `_fp8_gemv_kernel`, on the CUDA cores, for one to four rows: a tile is ``BLOCK_N`` weight rows by ``BLOCK_K``
  contiguous bytes, 16 bytes per thread per load (one 128-bit load), and the next step's tile is loaded before this
  step's arithmetic (a register double buffer: Triton pipelines only loads that feed a dot).  The tile is converted
  to float32 once and multiplied into one accumulator per row of x (``acc0`` .. ``acc3``, each thread summing its
  own 16 products; the row sums across threads once at the end): when the rows shared one 3-D
  product ``[rows, BLOCK_N, BLOCK_K]`` whose reshape Triton laid out through shared memory, which made two rows
  four times slower than one (0.348 against 0.087 ms per 8B layer on an H200);
- `_fp8_gemv_dot_kernel`, on the tensor cores, for more rows: the rows padded to ``BLOCK_M`` (16) as the
  narrow side of the product and the weight tile as the wide one ("swap AB"), the tiles loaded by Triton's software
  pipeline (``num_stages`` deep, in shared memory) and converted to x's 16-bit type on the way to the MMA, which is
  exact for e4m3.  With the register double buffer of the CUDA-core loop this path left Triton no pipeline to
  build, and was slower than bf16 at 3-16 rows (docs/decisions/quant-paths.md has both measurements);

and in the last two:

- every program covers all the rows of x, so the weight is read once whatever the batch; rows of x past the last
  are clamped to the last (loaded again, never stored), so that x's loads carry no mask;
- out-of-range weight rows are clamped to the last row instead of masked, so the loop's loads carry no mask
  unless K has a remainder;
- the grid is ``BLOCK_N``-row tiles times K splits (``WAVES`` programs per SM, each split at least ``MIN_STEPS``
  K steps); the splits' float32 partials are summed by the last split of each tile inside the kernel
  (kernels/splitk.py), so a call is one launch;
- the scale is one float32 per output row (or one for the tensor, PER_TENSOR), applied once to the sum.

The tiles per row count are CONFIGS, chosen by a sweep on one H200 (benchmarks/gemv_sweep.py,
docs/decisions/quant-paths.md).  kernels/fp8_linear.py's W8A16 kernel computes the same product with the old
tiles; benchmarks/quant_kernels.py times both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.fp8_linear import dot_dtype
from kernels.operands import rows
from kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options, mark_chained, pdl
from kernels.splitk import cdiv, num_sms, reduce_splits, split_geometry, store_or_finish, tickets

MAX_ROWS = 16  # the dot kernel holds all of x's rows in one tile of 16 (a 32-row tile measured 0.25 ms a layer)
VEC = tl.constexpr(16)  # e4m3 bytes per 128-bit load: one thread's run of K
CUDA_CORE_MAX_ROWS = 4  # the CUDA-core kernel's accumulators, one per row

# Tiles by row count: (rows up to, config), the fastest of benchmarks/gemv_sweep.py's trials on an H200 at the 8B's
# projections (docs/decisions/quant-paths.md, "The decode GEMVs swept and re-shaped": the dot from 3 rows, where the
# CUDA-core kernel lost).  KIND "cuda-core" or "dot"; WAVES programs per SM that the K splits aim for; MIN_STEPS the
# fewest K steps a split keeps.
CUDA_CORE_ONE_ROW = dict(
    KIND="cuda-core", BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1, WAVES=2, MIN_STEPS=4
)
# One row: the streaming kernel (8 weight rows x 512 bytes a step, 4 stages, 2 warps, 8 programs per SM), where K
# is whole 512-byte steps, else CUDA_CORE_ONE_ROW (benchmarks/quant_gemv1.py's trials, the decision document's
# "The one-row FP8 product as a pipelined stream").
STREAM_ONE_ROW = dict(KIND="stream", BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, STAGES=4, num_warps=2, CTAS=8)
CONFIGS: tuple[tuple[int, dict], ...] = (
    (1, STREAM_ONE_ROW),
    (2, dict(KIND="cuda-core", BLOCK_M=2, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=1, WAVES=2, MIN_STEPS=4)),
    (16, dict(KIND="dot", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, WAVES=4, MIN_STEPS=4)),
)


@triton.jit
def _row_product(acc, wf, x_row, offs_k, mask_k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """acc ``[BLOCK_N, BLOCK_K // VEC]`` + one row of x times the float32 tile `wf` (each thread's 16 products
    summed in registers)."""
    if EVEN_K:
        x = tl.load(x_row + offs_k)
    else:
        x = tl.load(x_row + offs_k, mask=mask_k, other=0.0)
    p = wf * x.to(tl.float32)[None, :]
    return acc + tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // VEC, VEC)), 2)


@triton.jit
def _row_sum(y, acc, offs_m, R: tl.constexpr):
    """y ``[BLOCK_M, BLOCK_N]`` with row R set to acc's sum over its columns."""
    return tl.where(offs_m[:, None] == R, tl.sum(acc, 1)[None, :], y)


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_om"])
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    part_ptr,
    ticket_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr,
    IN_KERNEL: tl.constexpr,
    PER_TENSOR: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """``out[m, n] = ws[n] * sum_k x[m, k] w[n, k]`` for this program's BLOCK_N rows of w over its split of K, on the
    CUDA cores, for BLOCK_M <= 4 rows of x.  EVEN_K: every split is whole BLOCK_K steps (no K mask anywhere)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_n, N - 1)  # clamped, not masked: the loads stay unpredicated
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    # rows of x past M read row M - 1 again (their sums are never stored)
    x0 = x_ptr
    x1 = x_ptr + tl.minimum(1, M - 1).to(tl.int64) * stride_xm
    x2 = x_ptr + tl.minimum(2, M - 1).to(tl.int64) * stride_xm
    x3 = x_ptr + tl.minimum(3, M - 1).to(tl.int64) * stride_xm
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    # register double buffer: the tile of step i + 1 is in flight while step i multiplies
    if EVEN_K:
        w_next = tl.load(w_rows + offs_k[None, :], eviction_policy="evict_first")
    else:
        w_next = tl.load(
            w_rows + offs_k[None, :], mask=(offs_k < k_end)[None, :], other=0.0, eviction_policy="evict_first"
        )
    for k0 in range(k_start, k_end, BLOCK_K):
        w = w_next
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        nxt = offs_k + BLOCK_K
        if EVEN_K:  # the step after the last is clamped into this split (a re-read of the last tile, never used)
            k_next = tl.minimum(k0 + BLOCK_K, k_end - BLOCK_K)
            w_next = tl.load(w_rows + (k_next + tl.arange(0, BLOCK_K))[None, :], eviction_policy="evict_first")
        else:
            w_next = tl.load(
                w_rows + nxt[None, :], mask=(nxt < k_end)[None, :], other=0.0, eviction_policy="evict_first"
            )
        wf = w.to(tl.float32)
        acc0 = _row_product(acc0, wf, x0, offs_k, mask_k, BLOCK_N, BLOCK_K, EVEN_K)
        if BLOCK_M > 1:
            acc1 = _row_product(acc1, wf, x1, offs_k, mask_k, BLOCK_N, BLOCK_K, EVEN_K)
        if BLOCK_M > 2:
            acc2 = _row_product(acc2, wf, x2, offs_k, mask_k, BLOCK_N, BLOCK_K, EVEN_K)
            acc3 = _row_product(acc3, wf, x3, offs_k, mask_k, BLOCK_N, BLOCK_K, EVEN_K)
    y = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    y = _row_sum(y, acc0, offs_m, 0)
    if BLOCK_M > 1:
        y = _row_sum(y, acc1, offs_m, 1)
    if BLOCK_M > 2:
        y = _row_sum(y, acc2, offs_m, 2)
        y = _row_sum(y, acc3, offs_m, 3)
    if PER_TENSOR:
        y = y * tl.load(ws_ptr)
    else:
        y = y * tl.load(ws_ptr + rows)[None, :]
    store_or_finish(y, out_ptr, part_ptr, ticket_ptr, offs_m, offs_n, M, N, stride_om, pid_n, split, SPLITS, IN_KERNEL)


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_om"])
def _fp8_gemv_dot_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    part_ptr,
    ticket_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr,
    IN_KERNEL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PER_TENSOR: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """The same product on the tensor cores: ``[BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M]`` per step, the weight
    tile the wide operand, its loads pipelined by Triton (``num_stages``)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_n, N - 1)
    x_rows = tl.minimum(offs_m, M - 1)  # rows past M read row M - 1 again (never stored)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + offs_k[None, :]
    x_ptrs = x_ptr + x_rows[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs)
        else:
            in_k = (k0 + tl.arange(0, BLOCK_K)) < k_end
            w = tl.load(w_ptrs, mask=in_k[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=in_k[:, None], other=0.0)
        if DOT_DTYPE == tl.float32:  # float32 activations: a float32 product, not TF32's
            acc = tl.dot(w.to(DOT_DTYPE), x.to(DOT_DTYPE), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(DOT_DTYPE), x.to(DOT_DTYPE), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if PER_TENSOR:
        y = y * tl.load(ws_ptr)
    else:
        y = y * tl.load(ws_ptr + rows)[None, :]
    store_or_finish(y, out_ptr, part_ptr, ticket_ptr, offs_m, offs_n, M, N, stride_om, pid_n, split, SPLITS, IN_KERNEL)


@triton.jit(do_not_specialize=["tiles"])
def _fp8_gemv_stream_kernel(
    x_ptr,
    w_ptr,
    w_desc,
    ws_ptr,
    out_ptr,
    N,
    K,
    tiles,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    TMA: tl.constexpr,
    PER_TENSOR: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One row of x: ``out[n] = ws[n] * sum_k x[k] w[n, k]``, K a multiple of BLOCK_K.  The grid need not cover
    the tiles: program p takes tiles p, p + grid, ... and runs one loop over all its (tile, K step) pairs, so that
    Triton's software pipeline (STAGES deep, through shared memory; TMA: the weight tiles by the bulk tensor-copy
    engine from `w_desc`) keeps loading across the tiles' boundaries; each tile's sum is stored after its last step.

    PDL (a programmatic dependent launch, kernels/pdl.py): the programs start while the kernel before finishes, wait
    for it (it wrote x) before the loop, then let the next kernel launch (it waits for this one in turn).  An L2
    prefetch of the first tiles before the wait was slower (docs/decisions/quant-paths.md)."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    k_steps = K // BLOCK_K
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    total = tl.cdiv(tiles - pid, grid) * k_steps
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    for i in tl.range(0, total, num_stages=STAGES):
        t = i // k_steps
        kk = (i - t * k_steps) * BLOCK_K
        n0 = (pid + t * grid) * BLOCK_N
        if TMA:
            w = w_desc.load([n0, kk])
        else:
            w_rows = tl.minimum(n0 + offs_b, N - 1)  # clamped, not masked
            w = tl.load(
                w_ptr + w_rows[:, None].to(tl.int64) * K + (kk + offs_k)[None, :], eviction_policy="evict_first"
            )
        x = tl.load(x_ptr + kk + offs_k)
        p = w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc += tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // VEC, VEC)), 2)
        if kk == K - BLOCK_K:  # the tile's last step: its sums out, the accumulators cleared
            offs_n = n0 + offs_b
            y = tl.sum(acc, 1)
            if PER_TENSOR:
                y = y * tl.load(ws_ptr)
            else:
                y = y * tl.load(ws_ptr + tl.minimum(offs_n, N - 1))
            tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)
            acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)


def fp8_gemv_config(m: int, n: int, k: int, device: torch.device, config: dict | None = None) -> dict:
    """CONFIGS' tiles for `m` rows (no autotuner: a first call compiles one kernel) updated by `config`, with SPLITS
    (unless `config` sets it): K split until the tiles make about WAVES programs per SM, each split keeping at
    least MIN_STEPS K steps."""
    base = next(c for rows_up_to, c in CONFIGS if m <= rows_up_to)
    if base["KIND"] == "stream" and (config or {}).get("KIND", "stream") != "stream":
        base = CUDA_CORE_ONE_ROW  # another kernel asked for at one row: its own tiles under the override
    cfg = dict(base, **(config or {}))
    if cfg["KIND"] == "stream":
        if m == 1 and k % cfg["BLOCK_K"] == 0:
            return cfg
        # the stream kernel takes one row and whole K steps: else the CUDA-core kernel's tiles
        cfg = dict(base if base["KIND"] != "stream" else CUDA_CORE_ONE_ROW)
    waves, min_steps = cfg.pop("WAVES"), cfg.pop("MIN_STEPS")
    if "SPLITS" not in cfg:
        cfg["SPLITS"] = splits_for(n, k, cfg["BLOCK_N"], cfg["BLOCK_K"], waves, min_steps, device)
    return cfg


def splits_for(n: int, k: int, block_n: int, block_k: int, waves: float, min_steps: int, device: torch.device) -> int:
    """K splits so that the ``cdiv(n, block_n)`` tiles make about `waves` programs per SM, each split keeping at
    least `min_steps` steps of `block_k`."""
    tiles = cdiv(n, block_n)
    target = int(waves * num_sms(device))
    if tiles >= target:
        return 1
    return max(1, min(cdiv(target, tiles), cdiv(k, block_k) // max(min_steps, 1)))


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    config: dict | None = None,
    in_kernel_sum: bool = True,
) -> torch.Tensor:
    """``x @ (weight x weight_scale)^T`` for x ``[..., K]`` (bf16, fp16 or fp32) with at most MAX_ROWS rows,
    weight e4m3 ``[N, K]`` row-major, weight_scale float32 ``[N]`` (per output row) or one element (per tensor);
    ``[..., N]`` in x's dtype.  `config` overrides fp8_gemv_config's tiles (and SPLITS; KIND "cuda-core" or
    "dot"); `in_kernel_sum` False sums the splits with a second kernel instead (the A/B of the device benchmark)."""
    shape = x.shape
    x2 = rows(x)
    m, k = x2.shape
    n = weight.shape[0]
    if weight.shape != (n, k) or weight.stride() != (k, 1) or weight_scale.numel() not in (1, n):
        raise ValueError(f"fp8 weight {tuple(weight.shape)} / scale {tuple(weight_scale.shape)} do not fit x [*, {k}]")
    if m > MAX_ROWS:
        raise ValueError(f"fp8_gemv takes at most {MAX_ROWS} rows, not {m}")
    cfg = fp8_gemv_config(min(max(m, 1), MAX_ROWS), n, k, x2.device, config)
    if cfg["KIND"] == "stream":
        return _stream(x2, weight, weight_scale, cfg).reshape(*shape[:-1], n)
    bm, bn, bk, splits = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("SPLITS")
    kind = cfg.pop("KIND")
    # DOT_FP16: the dot in float16 whatever x's type (a diagnostic of the sweep: what e4m3 -> bf16 costs over
    # e4m3 -> fp16; bf16 activations past fp16's range would overflow)
    dot_type = tl.float16 if cfg.pop("DOT_FP16", False) and x2.is_cuda else dot_dtype(x.dtype, x.device)
    if bm < m or (kind == "cuda-core" and bm > CUDA_CORE_MAX_ROWS):
        raise ValueError(f"BLOCK_M {bm} does not fit the {m} rows ({kind})")
    splits, k_per_split = split_geometry(k, bk, splits)
    tiles = cdiv(n, bn)
    ticket = tickets(x2.device, tiles) if splits > 1 and in_kernel_sum else None
    in_kernel = ticket is not None
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    if m and n:
        ticket_arg = ticket if in_kernel else out
        args = (x2, weight, weight_scale, out, part, ticket_arg, m, n, k, x2.stride(0), n, k_per_split)
        consts = dict(
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            SPLITS=splits,
            IN_KERNEL=in_kernel,
            PER_TENSOR=weight_scale.numel() == 1 and n != 1,
            EVEN_K=k % bk == 0,  # split_geometry's splits are whole BLOCK_K steps
        )
        if kind == "dot":
            _fp8_gemv_dot_kernel[(tiles, splits)](*args, DOT_DTYPE=dot_type, **consts, **cfg)
        elif kind == "cuda-core":
            _fp8_gemv_kernel[(tiles, splits)](*args, **consts, **cfg)
        else:
            raise ValueError(f"fp8_gemv KIND {kind!r}: expected 'cuda-core' or 'dot'")
        if splits > 1 and not in_kernel:
            out = reduce_splits(part, x.dtype)
    return out.reshape(*shape[:-1], n)


def _stream(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, cfg: dict) -> torch.Tensor:
    """`_fp8_gemv_stream_kernel` on one row of x: CTAS programs per SM (0: one per tile), the weight through a TMA
    descriptor where TMA is set and the device has the copy engine."""
    n, k = weight.shape
    cfg = dict(cfg)
    bn, bk = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    ctas, tma = cfg.pop("CTAS", 0), cfg.pop("TMA", False)
    for key in ("KIND", "BLOCK_M", "WAVES", "MIN_STEPS", "SPLITS"):
        cfg.pop(key, None)
    tma = tma and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9 and weight.data_ptr() % 16 == 0
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    tiles = cdiv(n, bn)
    grid = min(tiles, ctas * num_sms(x.device)) if ctas else tiles
    desc = TensorDescriptor.from_tensor(weight, [bn, bk]) if tma else None
    per_tensor = weight_scale.numel() == 1 and n != 1
    on = pdl(x.device)
    if on:
        mark_chained(x.device)  # the small kernels around this product may take PDL too (kernels/pdl.py)
    _fp8_gemv_stream_kernel[(grid,)](
        x,
        weight,
        desc,
        weight_scale,
        out,
        n,
        k,
        tiles,
        BLOCK_N=bn,
        BLOCK_K=bk,
        TMA=tma,
        PER_TENSOR=per_tensor,
        PDL=on,
        **cfg,
        **launch_options(on),
    )
    return out
