"""How the model's OpenMP threads wait between parallel regions: a short spin, then sleep, unless the operator says.

Why: torch's CPU ops run on libgomp's thread team.  A step is dozens to hundreds of parallel regions a few
microseconds apart, and a worker that slept between two of them has to be woken for the next; on a virtual machine
that wake is slow enough to nearly double a loaded CPU server's time per token (PASSIVE, which never spins).  A
spinning worker, on the other hand, burns the core that the straggler it waits for needs when other processes load
the cores (clients, other engines, a test suite): libgomp's own default spins a few milliseconds, and forever with
ACTIVE.  The engine spins SPIN_COUNT rounds, long enough to bridge the gaps inside a step and short enough to sleep
between requests; OMP_WAIT_POLICY=ACTIVE comes with it because libgomp otherwise cuts the spin to 1,000 rounds when
it counts more of its threads than cores.  What each choice cost, alone and beside busy processes:
docs/decisions/openmp-waits.md.

libgomp reads the setting once, when it is loaded (with torch), so this runs first in an engine process's entry
point, before anything imports torch.  An operator who sets OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME
keeps their setting (PASSIVE: the least CPU on a shared host; ACTIVE alone: spin without end, on cores dedicated to
one engine).  A CPU engine's `engine_ready` log line names the setting in force (`openmp_waits`).
"""

from __future__ import annotations

import os
import sys

WAIT_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
SPIN_COUNT = 100_000  # libgomp's rounds of spinning at a barrier before a worker sleeps
DEFAULT_WAITS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": str(SPIN_COUNT)}


def chosen_waits() -> dict[str, str]:
    """The wait knobs set in this environment; an empty value counts as unset (libgomp ignores it too)."""
    return {k: os.environ[k] for k in WAIT_KNOBS if os.environ.get(k)}


def set_default_waits() -> None:
    """Make OpenMP's idle threads spin briefly, then sleep, unless the operator chose a wait setting or torch is
    already loaded."""
    if chosen_waits() or "torch" in sys.modules:
        return
    os.environ.update(DEFAULT_WAITS)


def wait_policy() -> str:
    """The wait setting this process runs with, in words for the start-up log."""
    chosen = [f"{k}={v}" for k, v in chosen_waits().items()]
    return ", ".join(chosen) or "libgomp default (spin, then sleep)"
