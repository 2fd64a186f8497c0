"""How the model's OpenMP threads wait between parallel regions: they sleep (PASSIVE) unless the operator says.

Why: torch's CPU ops run on libgomp's thread team, whose idle threads by default spin for a while at every
barrier before they sleep.  A decode step on the CPU is hundreds of small parallel regions, so on a host whose
cores are also busy (the HTTP thread, a supervisor, clients, other engines) a spinning thread burns the core that
the straggler it waits for needs: beside two busy processes PASSIVE halved the CPU per token and more
(docs/decisions/openmp-waits.md).

libgomp reads the policy once, when it is loaded (with torch), so this runs first in an engine process's entry
point, before anything imports torch.  An operator who sets OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME
keeps their setting (ACTIVE can win on cores dedicated to one engine).  A CPU engine's `engine_ready` log line
names the setting in force (`openmp_waits`).
"""

from __future__ import annotations

import os
import sys

WAIT_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
DEFAULT_POLICY = "PASSIVE"


def prefer_passive_waits() -> None:
    """Make OpenMP's idle threads sleep, unless the operator chose a wait setting or torch is already loaded."""
    if any(k in os.environ for k in WAIT_KNOBS) or "torch" in sys.modules:
        return
    os.environ["OMP_WAIT_POLICY"] = DEFAULT_POLICY


def wait_policy() -> str:
    """The wait setting this process runs with, in words for the start-up log."""
    chosen = [f"{k}={os.environ[k]}" for k in WAIT_KNOBS if k in os.environ]
    return ", ".join(chosen) or "libgomp default (spin, then sleep)"
