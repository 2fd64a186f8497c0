"""The CPU server keeps a core for HTTP and binds the model's threads to the rest, as vLLM's CPU backend does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from engine.config import ConfigError
from engine.cpu_threads import plan_cpu_threads
from engine.openmp_waits import SPIN_COUNT, WAIT_KNOBS


def test_the_plan_keeps_one_core_of_four_by_default_and_refuses_to_keep_them_all() -> None:
    assert plan_cpu_threads((0, 1, 2, 3), None).compute_cores == (0, 1, 2)
    assert plan_cpu_threads((0, 1, 2, 3), None).serving_cores == (3,)
    assert plan_cpu_threads((0, 1), 1).compute_cores == (0,)
    assert plan_cpu_threads((3, 5, 7, 9), 2).compute_cores == (3, 5)
    assert not plan_cpu_threads((0, 1), None).binds  # two cores: both compute unless asked
    assert not plan_cpu_threads((0,), None).binds  # one core: nothing to split
    assert not plan_cpu_threads((0, 1, 2), 0).binds
    with pytest.raises(ConfigError, match="--cpu-reserved-cores 2 leaves no core for the model"):
        plan_cpu_threads((0, 1), 2)


def _allowed(pid: int) -> dict[int, str]:
    """Each thread of `pid`: the cores it may run on (/proc's Cpus_allowed_list)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        out[int(task.name)] = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Cpus_allowed_list"))
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs at least two cores")
def test_a_cpu_server_keeps_a_core_for_its_event_loop(launch) -> None:
    # the engine's own wait default: the knobs the test run set for itself (tests/conftest.py) cleared
    server = launch("--cpu-reserved-cores", "1", env=dict.fromkeys(WAIT_KNOBS, ""))
    r = httpx.post(server.url + "/v1/completions", json={"model": "pagekeeper-default", "prompt": "Now is"})
    assert r.status_code == 200
    bound = [json.loads(ln) for ln in server.log().splitlines() if '"cpu_threads_bound"' in ln]
    ready = [json.loads(ln) for ln in server.log().splitlines() if '"engine_ready"' in ln]
    assert ready[0]["openmp_waits"] == f"OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT={SPIN_COUNT}"  # engine/openmp_waits.py
    up = [json.loads(ln) for ln in server.log().splitlines() if '"serving"' in ln]
    assert up[0]["gc_frozen_objects"] > 50_000  # the start-up heap, out of full collections (engine/gc_heap.py)
    assert len(bound) == 1, server.log()[-2000:]
    compute, serving = bound[0]["compute_cores"], bound[0]["serving_cores"]
    allowed = _allowed(server.proc.pid)
    print(f"compute cores {compute}, serving cores {serving}, pinned {bound[0]['pinned']}; threads: {allowed}")
    assert bound[0]["torch_threads"] == len(compute) == len(os.sched_getaffinity(0)) - 1
    if bound[0]["pinned"]:  # two or more compute cores: the event loop and the model never share one
        assert allowed[server.proc.pid] == ",".join(map(str, serving))
        assert any(v == ",".join(map(str, compute)) for v in allowed.values())
    else:  # one model thread: nothing to stall at a barrier, so the scheduler places both
        assert len(compute) == 1 and len(set(allowed.values())) == 1


def test_two_compute_cores_are_pinned_one_is_not() -> None:
    assert plan_cpu_threads((0, 1, 2), 1).pins
    assert not plan_cpu_threads((0, 1), 1).pins


def test_the_flag_is_refused_where_it_could_not_apply() -> None:
    """Tensor-parallel ranks (and GPU engines) set their own threads: the flag is an error there, not ignored."""
    import subprocess
    import sys

    from tests.server.harness import REPO, free_port

    r = subprocess.run(
        [sys.executable, "-m", "engine.server", "--port", str(free_port()), "--cpu-reserved-cores", "1",
         "--tensor-parallel-size", "2"],
        capture_output=True, text=True, timeout=120, cwd=str(REPO),
    )  # fmt: skip
    print(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 2 and "--cpu-reserved-cores 1" in r.stderr and "tensor-parallel" in r.stderr
