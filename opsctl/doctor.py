"""`opsctl doctor`: the environment checks an SRE runs before (or instead of) starting the engine.

Each check prints one line, pass or fail, with what to change when it fails.  The memory plan is
computed from the checkpoint's files, so it works on a machine where the engine could not start.
"""

from __future__ import annotations

import os
import socket
from typing import Callable

from engine.config import ConfigError, EngineConfig
from opsctl import control
from opsctl.config import PagekeeperConfig
from opsctl.probes import gpu_probe

RECOMMENDED_ALLOC_CONF = "expandable_segments:True"


def run_checks(cfg: PagekeeperConfig, echo: Callable[[str], None]) -> bool:
    ok = True

    def report(passed: bool | None, what: str, detail: str) -> None:
        nonlocal ok
        mark = {True: "ok  ", False: "FAIL", None: "warn"}[passed]
        echo(f"[{mark}] {what:<18} {detail}")
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


def _checkpoint(econf: EngineConfig, report) -> bool:  # type: ignore[no-untyped-def]
    """Every safetensors file readable, every weight present with its shape (headers only, no data)."""
    from engine.model.loader import check_checkpoint, inspect_model

    try:
        tensors = check_checkpoint(inspect_model(econf))
    except ConfigError as e:
        report(False, "checkpoint", str(e))
        return False
    report(True, "checkpoint", f"{tensors} tensors, every weight present with the expected shape")
    return True


def _memory_plan(cfg: PagekeeperConfig, gpu, report) -> bool:  # type: ignore[no-untyped-def]
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
        g = readings[0] if readings else None
        plan = estimate(econf, g.memory_total_bytes if g else None, g.memory_used_bytes if g else 0)
    except (ConfigError, OSError, RuntimeError) as e:
        report(False, "model", str(e))
        return False
    report(
        True,
        "model",
        f"{econf.model_path()} ({plan.architecture}, {plan.dtype}, weights {plan.weight_bytes / 2**20:.1f} MiB)",
    )
    report(
        True,
        "kv per token",
        f"{plan.kv_bytes_per_token} bytes; {plan.kv_bytes_per_block} per block of {plan.block_size}",
    )
    if plan.kv_budget_bytes is None:
        report(None, "kv budget", plan.kv_budget_source)
        return True
    fits = plan.max_concurrency is not None and plan.max_concurrency >= 1
    report(
        fits,
        "kv budget",
        f"{plan.kv_budget_bytes / 2**30:.2f} GiB ({plan.kv_budget_source}) = "
        f"{plan.kv_tokens} tokens, {plan.max_concurrency:.1f} sequences of max_model_len "
        f"{plan.max_model_len}" + ("" if fits else "; lower --max-model-len or raise the budget"),
    )
    return fits
