"""Which CPU cores the model computes on and which the server keeps for HTTP, tokenizing and detokenizing.

On a CPU the model's intra-op threads (one per core by default) and the server's event loop compete for the same cores.
An operator's parallel region waits at its barrier for every thread, so when the event loop (or any other process) takes
one core for a moment, every small op of the step waits for it (a decode step on a busy 2-core machine ran 4x slower:
docs/decisions/cpu-reserved-cores.md).  vLLM's CPU backend reserves one core for its API server and runs the model's
threads on the rest; pagekeeper does the same by default (`--cpu-reserved-cores`, 0 turns it off).

With two or more compute cores the step loop's thread (and the OpenMP workers it starts) is pinned to them and the
rest of the process to the reserved cores, so that no model thread shares a core with the event loop.  With one
compute core there is no team to stall, and nothing is pinned: one model thread and the event loop are best placed
by the kernel's scheduler on a machine that also runs other work (pinned, the event loop waited behind other
processes on its one core and a supervisor's probes timed out in a loaded test run).  A GPU engine keeps the
default (its threads mostly wait for the device).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import structlog

from engine.config import ConfigError

log = structlog.get_logger("pagekeeper.server")

# Below this many cores nothing is reserved by default: on a 2-core machine that also runs clients, a supervisor
# and tests, one model thread left the engine too slow under load for the supervisor's cache-pressure rule to see a
# stuck cache (tests/opsctl/test_supervisor_faults.py failed with two busy processes beside it, and passed with the
# default two threads).  `--cpu-reserved-cores 1` still buys the lower TPOT on such a machine when it serves alone
# (docs/benchmarks.md: vLLM's CPU build side by side).
AUTO_RESERVE_MIN_CORES = 4


@dataclass(frozen=True)
class CpuThreadPlan:
    compute_cores: tuple[int, ...]  # the step loop and the model's intra-op threads
    serving_cores: tuple[int, ...]  # the event loop, tokenizer and everything else (empty: no binding)

    @property
    def binds(self) -> bool:
        """The model's thread count follows the plan."""
        return bool(self.serving_cores)

    @property
    def pins(self) -> bool:
        """Threads are pinned to their cores (only a team of two or more model threads needs it)."""
        return self.binds and len(self.compute_cores) >= 2


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity, which a container or taskset may have narrowed)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def plan_cpu_threads(cores: tuple[int, ...], reserved: int | None) -> CpuThreadPlan:
    """`reserved` cores (None: one when there are at least four) for serving; the rest compute."""
    if reserved is None:
        reserved = 1 if len(cores) >= AUTO_RESERVE_MIN_CORES else 0
    if reserved <= 0 or not hasattr(os, "sched_setaffinity"):
        return CpuThreadPlan(cores, ())
    if reserved >= len(cores):
        raise ConfigError(
            f"--cpu-reserved-cores {reserved} leaves no core for the model: this process may use {len(cores)} "
            f"({', '.join(map(str, cores))}); use at most {len(cores) - 1}, or 0 to bind nothing"
        )
    return CpuThreadPlan(cores[:-reserved], cores[-reserved:])


def bind_serving_threads(plan: CpuThreadPlan) -> None:
    """Called on the main thread: it and the threads it starts later stay on the serving cores."""
    if plan.pins:
        os.sched_setaffinity(0, plan.serving_cores)  # 0: the calling thread only (Linux)


def bind_compute_thread(plan: CpuThreadPlan) -> None:
    """Called on the step loop's thread before its first step: OpenMP starts its workers from it, so they
    inherit these cores; one intra-op thread per compute core."""
    if not plan.binds:
        return
    import torch  # here: a front whose core runs in its own process (engine/loop/) never imports it

    if plan.pins:
        os.sched_setaffinity(0, plan.compute_cores)
    torch.set_num_threads(len(plan.compute_cores))
    log.info(
        "cpu_threads_bound",
        compute_cores=list(plan.compute_cores),
        serving_cores=list(plan.serving_cores),
        torch_threads=torch.get_num_threads(),
        pinned=plan.pins,
    )
