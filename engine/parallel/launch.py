"""What every tensor-parallel rank does the same way: pick its device, join the process group.

One process per rank, on one host: rank r uses `cuda:r` of the GPUs CUDA_VISIBLE_DEVICES shows
(NCCL), or the CPU (gloo, which is how CI runs all of it).  The rendezvous is a TCPStore that rank 0
opens on an ephemeral loopback port before it spawns the others, so two engines on one machine
(a supervised restart overlaps them) never race for a port.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch

from engine.config import ConfigError, EngineConfig, ResolvedConfig
from engine.parallel.group import TPGroup
from engine.parallel.peer_allreduce import PeerAllReduce, mode_from_env, set_up_for

# A collective that waits longer than this means a rank is gone or stuck: NCCL/gloo raise, the rank
# exits and the engine stops with exit 1 (never an engine that hangs).  Generous, because the first
# step of each shape compiles Triton kernels on every rank before its first all-reduce.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)


def rank_device(config: EngineConfig | ResolvedConfig, rank: int) -> torch.device:
    """The device of `rank`; ConfigError when the GPUs are too few or a single one was named."""
    device = config.resolved_device()
    size = config.tensor_parallel_size
    if device == "cpu":
        return torch.device("cpu")
    if size > 1 and device != "cuda":
        raise ConfigError(
            f"--device {device} with --tensor-parallel-size {size}: rank r uses cuda:r; choose the GPUs "
            "with CUDA_VISIBLE_DEVICES and pass --device cuda"
        )
    if size == 1:
        return torch.device(device)
    visible = torch.cuda.device_count()
    if visible < size:
        raise ConfigError(
            f"--tensor-parallel-size {size} needs {size} GPUs, {visible} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            f"use --tensor-parallel-size {visible} or make more GPUs visible"
        )
    return torch.device(f"cuda:{rank}")


def cpu_threads_per_rank(size: int) -> int:
    """CPU ranks share the cores: oversubscribed threads make every all-reduce wait for the slowest."""
    return max(1, (os.cpu_count() or 1) // size)


def join_group(store: Any, rank: int, size: int, device: torch.device, overlap_tokens: int = 0) -> TPGroup:
    """Join the group; `overlap_tokens` (--tensor-parallel-overlap-tokens) > 0 also puts NCCL's collectives on a
    high-priority stream, so that an all-reduce issued beside a GEMM (engine/model/overlap.py) is scheduled on
    the SMs the GEMM frees instead of queueing behind all of its blocks."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl",
            store=store,
            rank=rank,
            world_size=size,
            timeout=COLLECTIVE_TIMEOUT,
            device_id=device,
            pg_options=_nccl_options(overlap_tokens > 0),
        )
        peer = _peer_all_reduce(device)
        return TPGroup(rank, size, None, overlap_tokens, peer)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback, whatever the hostname resolves to
        torch.set_num_threads(cpu_threads_per_rank(size))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(rank, size, None, overlap_tokens)


def _peer_all_reduce(device: torch.device) -> PeerAllReduce | None:
    """The symmetric-memory sum for small all-reduces (engine/parallel/peer_allreduce.py), or None: NCCL for all.
    Where it does not set up, one warning says why and NCCL does every sum."""
    import structlog

    mode = mode_from_env()
    peer, why = set_up_for(None, device, mode)
    log = structlog.get_logger("pagekeeper.engine")
    if peer is not None:
        log.info("tp_allreduce", path="symmetric_memory", max_bytes=peer.max_bytes)
    elif why is not None:
        log.warning("tp_allreduce_falls_back_to_nccl", reason=why)
    return peer


def _nccl_options(high_priority: bool) -> Any:
    """NCCL's options with a high-priority stream, or None (the defaults)."""
    if not high_priority:
        return None
    import torch.distributed as dist

    try:  # the form torch.distributed.init_process_group's own documentation gives
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    except (AttributeError, TypeError) as e:  # a torch without it: the overlap still runs, on a normal stream
        import structlog

        structlog.get_logger("pagekeeper.engine").warning("nccl_high_priority_stream_unavailable", error=str(e))
        return None
    try:
        options._timeout = COLLECTIVE_TIMEOUT  # the group's own (torch warns when the two differ)
    except AttributeError:
        pass
    return options
