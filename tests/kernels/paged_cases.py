"""Random paged-attention inputs and a float64 oracle, shared by the kernel tests and the benchmark.

Everything is random (never zeros): the whole cache, including slots no sequence owns, so a kernel
that reads past a sequence's end or through the wrong block picks up garbage and fails.  Block
tables are random permutations of the pool (non-contiguous), padded with valid block ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Case:
    query: torch.Tensor  # [T, Hq, D]
    kv_cache: torch.Tensor  # [2, NB, Hkv, bs, D]
    block_tables: torch.Tensor  # [B, maxb] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    q_lens: list[int]
    lens: list[int]
    scale: float

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.lens)

    def args(self) -> tuple:
        return (
            self.query,
            self.kv_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
            self.max_query_len,
            self.max_seq_len,
        )


def make_case(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    q_lens: list[int],
    seq_lens: list[int],
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 7,
) -> Case:
    assert all(1 <= q <= L for q, L in zip(q_lens, seq_lens))
    g = torch.Generator(device=device).manual_seed(seed)
    nblk = [-(-L // block_size) for L in seq_lens]
    pool = sum(nblk) + spare_blocks
    cache = torch.randn(2, pool, num_kv_heads, block_size, head_dim, generator=g, device=device).to(dtype)
    perm = torch.randperm(pool, generator=g, device=device).to(torch.int32)
    width = max(nblk)
    tables = perm[-1].repeat(len(seq_lens), width)  # padding: a valid block id that is not the sequence's
    start = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[start : start + n]
        start += n
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g, device=device).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return Case(
        query,
        cache,
        tables.contiguous(),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        qsl.to(device),
        list(q_lens),
        list(seq_lens),
        head_dim**-0.5,
    )


def reference_fp64(case: Case) -> torch.Tensor:
    """The attention every kernel must compute, in float64, one sequence at a time (syncs freely)."""
    q_all, cache = case.query.double(), case.kv_cache
    num_heads, num_kv_heads = q_all.shape[1], cache.shape[2]
    bs = cache.shape[3]
    out = torch.empty_like(q_all)
    row = 0
    for b, (ql, L) in enumerate(zip(case.q_lens, case.lens)):
        blocks = case.block_tables[b, : -(-L // bs)].long()
        k = cache[0, blocks].double().permute(1, 0, 2, 3).reshape(num_kv_heads, -1, cache.shape[4])[:, :L]
        v = cache[1, blocks].double().permute(1, 0, 2, 3).reshape(num_kv_heads, -1, cache.shape[4])[:, :L]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=0)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=0)
        q = q_all[row : row + ql].transpose(0, 1)  # [Hq, ql, D]
        s = (q @ k.transpose(1, 2)) * case.scale  # [Hq, ql, L]
        q_pos = torch.arange(L - ql, L, device=s.device)[:, None]
        s = s.masked_fill(torch.arange(L, device=s.device)[None, :] > q_pos, float("-inf"))
        out[row : row + ql] = (torch.softmax(s, dim=-1) @ v).transpose(0, 1)
        row += ql
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||; NaN anywhere (an unwritten, poisoned element) gives inf."""
    out = out.double()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out - ref).norm() / ref.norm())


# ||out - ref|| / ||ref|| against the float64 oracle.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
