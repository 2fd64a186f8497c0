"""`opsctl doctor`: the environment checks an SRE runs before (or instead of) starting the engine.

Each check prints one line, pass or fail, with what to change when it fails.  The memory plan is
computed from the checkpoint's files, so it works on a machine where the engine could not start.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

from engine.config import ConfigError, EngineConfig
from engine.kv.kv_cache_manager import blocks_for_tokens
from opsctl import control
from opsctl.config import PagekeeperConfig
from opsctl.probes import GpuProbe, gpu_probe

# One line of the report: passed (None: not applicable), what was checked, and what was found.
Report = Callable[[bool | None, str, str], None]

RECOMMENDED_ALLOC_CONF = "expandable_segments:True"


def run_checks(cfg: PagekeeperConfig, echo: Callable[[str], None], collect: list[dict[str, Any]] | None = None) -> bool:
    """Each check as one line to `echo`, and as {"check", "status": ok|fail|warn, "detail"} into `collect`."""
    ok = True

    def report(passed: bool | None, what: str, detail: str) -> None:
        nonlocal ok
        mark = {True: "ok  ", False: "FAIL", None: "warn"}[passed]
        echo(f"[{mark}] {what:<18} {detail}")
        if collect is not None:
            collect.append({"check": what, "status": mark.strip().lower(), "detail": detail})
        if passed is False:
            ok = False

    import torch

    report(True, "config", cfg.source)
    report(True, "torch", f"{torch.__version__}, CUDA {'available' if torch.cuda.is_available() else 'not available'}")
    gpu = gpu_probe()
    if gpu.available:
        readings = gpu.read()
        report(True, "nvml", gpu.reason)
        for g in readings:
            free = (g.memory_total_bytes - g.memory_used_bytes) / 2**30
            report(
                free > 1, f"gpu {g.index}", f"{g.name}: {free:.1f} GiB free of {g.memory_total_bytes / 2**30:.1f} GiB"
            )
    else:
        report(None, "nvml", f"{gpu.reason} (fine on a CPU-only machine; GPU readings will be absent)")
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if conf is None:
        report(None, "allocator", f"PYTORCH_CUDA_ALLOC_CONF unset (recommended on GPUs: {RECOMMENDED_ALLOC_CONF})")
    else:
        report(
            "expandable_segments:True" in conf,
            "allocator",
            f"PYTORCH_CUDA_ALLOC_CONF={conf}"
            + ("" if "expandable_segments:True" in conf else f" (recommended: {RECOMMENDED_ALLOC_CONF})"),
        )
    runtime = cfg.supervisor.runtime_path()
    if control.is_running(runtime):
        report(True, "supervisor", f"running (socket {control.socket_path(runtime)})")
    else:
        report(
            _port_free(cfg.host, cfg.port),
            "port",
            f"{cfg.host}:{cfg.port} "
            + ("free" if _port_free(cfg.host, cfg.port) else "in use by another process; change [engine] port"),
        )
    ok = _memory_plan(cfg, gpu, report) and ok
    return ok


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _checkpoint(econf: EngineConfig, report: Report) -> bool:
    """Every safetensors file readable, every weight present with its shape (headers only, no data)."""
    from engine.model.loader import check_checkpoint, inspect_model

    try:
        tensors = check_checkpoint(inspect_model(econf))
    except ConfigError as e:
        report(False, "checkpoint", str(e))
        return False
    report(True, "checkpoint", f"{tensors} tensors, every weight present with the expected shape")
    return True


def _memory_plan(cfg: PagekeeperConfig, gpu: GpuProbe, report: Report) -> bool:
    from engine.memory.estimate import estimate

    engine_kwargs = {k: v for k, v in cfg.engine.items() if k in EngineConfig.field_names()}
    try:
        econf = EngineConfig.from_kwargs(**engine_kwargs)
    except ConfigError as e:
        report(False, "model", str(e))
        return False
    if econf.load_format != "dummy" and not _checkpoint(econf, report):
        return False
    try:
        readings = gpu.read() if gpu.available else []
        plan = estimate(econf, [(g.memory_total_bytes, g.memory_used_bytes) for g in readings])
    except (ConfigError, OSError, RuntimeError) as e:
        report(False, "model", str(e))
        return False
    tp = econf.tensor_parallel_size
    report(
        True,
        "model",
        f"{econf.model_path()} ({plan.architecture}, {plan.dtype}, weights {plan.weight_bytes / 2**20:.1f} MiB"
        + (f" per rank x {tp} ranks)" if tp > 1 else ")"),
    )
    first = plan.ranks[0]
    by_dtype = ", ".join(f"{name} {_size(n)}" for name, n in first.weight_bytes_by_dtype.items())
    if plan.quantization:
        report(
            True,
            "weights",
            f"{by_dtype} = {_size(first.weight_bytes)}{' per rank' if tp > 1 else ''}: {plan.quantization}; "
            f"{_size(first.unquantized_weight_bytes)} unquantized in {plan.dtype} "
            f"({first.unquantized_weight_bytes / max(1, first.weight_bytes):.2f}x)",
        )
    else:
        report(True, "weights", f"{by_dtype} (--quantization fp8 stores the linear layers in one byte per weight)")
    if readings and len(readings) < tp:
        report(False, "tensor parallel", f"--tensor-parallel-size {tp} needs {tp} GPUs, NVML sees {len(readings)}")
        return False
    other = "auto" if econf.kv_cache_fp8 else "fp8"
    report(
        True,
        "kv per token",
        f"{plan.kv_bytes_per_token} bytes in {plan.kv_dtype}; {plan.kv_bytes_per_block} per block of {plan.block_size}"
        + (" (per rank)" if tp > 1 else "")
        + f"; {plan.kv_bytes_per_token_other} with --kv-cache-dtype {other}",
    )
    if plan.kv_budget_bytes is None:
        report(None, "kv budget", plan.kv_budget_source)
        return True
    ok = True
    for r in plan.ranks:
        tokens = plan.rank_kv_tokens(r) or 0
        seqs = tokens / (blocks_for_tokens(plan.max_model_len, plan.block_size) * plan.block_size)
        fits = seqs >= 1
        ok = ok and fits
        report(
            fits,
            "kv budget" if tp == 1 else f"kv rank {r.rank}",
            f"{(r.kv_budget_bytes or 0) / 2**30:.2f} GiB ({plan.kv_budget_source}) = "
            f"{tokens} tokens, {seqs:.1f} sequences of max_model_len {plan.max_model_len}"
            + (f"; weights {_size(r.weight_bytes)}" if tp > 1 else "")
            + ("" if fits else "; lower --max-model-len or raise the budget"),
        )
    if tp > 1:
        report(ok, "kv usable", f"{plan.usable_kv_tokens} tokens (every rank holds the same blocks: the smallest wins)")
    return ok


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
