"""Engine processes make OpenMP's idle threads sleep unless the operator chose a wait setting (engine/openmp_waits.py).

Each check runs in a fresh interpreter, because libgomp reads the policy once, when torch loads it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.openmp_waits import WAIT_KNOBS
from tests.server.harness import REPO

POLICY = (
    "from engine.openmp_waits import prefer_passive_waits, wait_policy; prefer_passive_waits(); print(wait_policy())"
)

# One parallel matmul on two threads, then 2 s of sleep on the main thread: the CPU the process used while it slept
# is what OpenMP's idle worker burned.
IDLE_BURN = """
import os, time
from engine.openmp_waits import prefer_passive_waits
prefer_passive_waits()
import torch
torch.set_num_threads(2)
a = torch.randn(512, 512)
for _ in range(20):
    a @ a
t = os.times()
time.sleep(2.0)
u = os.times()
print(round((u.user + u.system) - (t.user + t.system), 3))
"""


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in WAIT_KNOBS}
    r = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def test_passive_unless_the_operator_set_a_wait_knob_or_torch_is_already_loaded() -> None:
    assert _run(POLICY) == "OMP_WAIT_POLICY=PASSIVE"
    assert _run(POLICY, OMP_WAIT_POLICY="active") == "OMP_WAIT_POLICY=active"
    assert _run(POLICY, GOMP_SPINCOUNT="10000") == "GOMP_SPINCOUNT=10000"
    assert _run(POLICY, KMP_BLOCKTIME="1") == "KMP_BLOCKTIME=1"
    late = "import torch; " + POLICY  # too late to matter: the engine leaves it alone and says so
    assert _run(late) == "libgomp default (spin, then sleep)"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="an idle OpenMP worker needs a second core")
def test_the_default_idle_worker_sleeps_where_an_active_one_burns_a_core() -> None:
    """The setting reaches libgomp: with the engine's default the process uses (almost) no CPU while its main thread
    sleeps after a parallel op; with OMP_WAIT_POLICY=ACTIVE its idle worker spins through the whole sleep."""
    passive = float(_run(IDLE_BURN))
    active = float(_run(IDLE_BURN, OMP_WAIT_POLICY="ACTIVE"))
    print(f"CPU seconds used during a 2 s sleep after a parallel op: default {passive}, ACTIVE {active}")
    assert passive < 0.1
    assert active > 0.3  # a spinning worker: a whole core while it gets one, a share of it on a loaded machine
