"""Engine processes make OpenMP's idle threads spin briefly, then sleep, unless the operator chose a wait setting
(engine/openmp_waits.py).

Each check runs in a fresh interpreter, because libgomp reads the policy once, when torch loads it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.openmp_waits import SPIN_COUNT, WAIT_KNOBS
from tests.server.harness import REPO

POLICY = "from engine.openmp_waits import set_default_waits, wait_policy; set_default_waits(); print(wait_policy())"

# One parallel matmul on two threads, then 2 s of sleep on the main thread: the CPU the process used while it slept,
# less that of a busy-looping control thread beside it, is what OpenMP's idle worker burned; the control's CPU is
# what a thread that never sleeps got of the machine in the same 2 s (a share of a core when others load it).
IDLE_BURN = """
import os, threading, time
from engine.openmp_waits import set_default_waits
set_default_waits()
import torch
torch.set_num_threads(2)
a = torch.randn(512, 512)
for _ in range(20):
    a @ a
control = {}
def busy():
    start, end = time.thread_time(), time.monotonic() + 2.0
    while time.monotonic() < end:
        pass
    control["cpu"] = time.thread_time() - start
t = os.times()
thread = threading.Thread(target=busy)
thread.start()
time.sleep(2.0)
thread.join()
u = os.times()
used = (u.user + u.system) - (t.user + t.system)
print(round(used - control["cpu"], 3), round(control["cpu"], 3))
"""


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in WAIT_KNOBS}
    r = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def test_a_short_spin_unless_the_operator_set_a_wait_knob_or_torch_is_already_loaded() -> None:
    assert _run(POLICY) == f"OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT={SPIN_COUNT}"
    assert _run(POLICY, OMP_WAIT_POLICY="active") == "OMP_WAIT_POLICY=active"
    # an empty knob is no choice (libgomp ignores it too): the default, with the empty one left out of the log
    assert _run(POLICY, OMP_WAIT_POLICY="", KMP_BLOCKTIME="") == f"OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT={SPIN_COUNT}"
    assert _run(POLICY, GOMP_SPINCOUNT="10000") == "GOMP_SPINCOUNT=10000"
    assert _run(POLICY, KMP_BLOCKTIME="1") == "KMP_BLOCKTIME=1"
    late = "import torch; " + POLICY  # too late to matter: the engine leaves it alone and says so
    assert _run(late) == "libgomp default (spin, then sleep)"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="an idle OpenMP worker needs a second core")
def test_the_default_idle_worker_sleeps_where_an_active_one_burns_a_core() -> None:
    """The setting reaches libgomp: with the engine's default (a short spin) the process uses (almost) no CPU while
    its main thread sleeps after a parallel op; with OMP_WAIT_POLICY=ACTIVE and no spin count its idle worker spins
    through the whole sleep."""
    default, _ = map(float, _run(IDLE_BURN).split())
    active, busy = map(float, _run(IDLE_BURN, OMP_WAIT_POLICY="ACTIVE").split())
    print(f"the idle worker's CPU seconds in a 2 s sleep: default {default}, ACTIVE {active} (a busy thread: {busy})")
    assert default < 0.1
    # a spinning worker takes what a busy thread gets: a whole core on an idle machine, a share of one on a loaded
    # machine (0.16 s in a run where the load average was 7 on two cores), so it is compared with a busy thread's
    assert active > 0.3 * busy and busy > 0.05
