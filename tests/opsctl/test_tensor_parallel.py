"""opsctl runs a tensor-parallel engine (2 CPU ranks over gloo) end to end: start, serve, restart
on request, and restart on its own when a rank dies, every worker process going with its engine."""

from __future__ import annotations

import json
import signal
import time

import httpx
import psutil
import pytest

from tests.server.harness import tp_workers

pytestmark = pytest.mark.slow

MODEL = "pagekeeper-default"


def _gone(p: psutil.Process, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def _complete(url: str) -> str:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": "Now is", "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _gpu(index: int, xid: int) -> dict:
    return {
        "index": index,
        "name": "Fake H200",
        "memory_used_bytes": (100 + index) * 2**30,
        "memory_total_bytes": 141 * 2**30,
        "utilization_ratio": 0.5,
        "temperature_celsius": 60.0,
        "xid_errors_total": xid,
    }


def test_opsctl_serves_restarts_and_recovers_a_tp2_engine(deploy, tmp_path):
    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps([_gpu(0, 0), _gpu(1, 3)]))  # NVML as two GPUs, an XID on the second
    d = deploy(engine={"tensor_parallel_size": 2, "max_num_seqs": 8})
    r = d.opsctl("start", env={"PAGEKEEPER_FAKE_NVML": str(gpus)})
    assert r.returncode == 0, r.stdout + r.stderr + d.log("supervisor.log")[-3000:]
    first = d.engine_pid()
    (worker,) = tp_workers(first)
    assert _complete(d.url) == " better than never."
    m = d.supervisor_metrics()
    assert m["pagekeeper_gpu_memory_used_bytes{gpu=1}"] == 101 * 2**30
    assert (m["pagekeeper_gpu_xid_errors_total{gpu=0}"], m["pagekeeper_gpu_xid_errors_total{gpu=1}"]) == (0, 3)
    status = d.opsctl("status").stdout
    assert "gpu 0 " in status and "gpu 1 " in status and "xid 3" in status, status

    r = d.opsctl("restart", "--drain-timeout", "5")
    assert r.returncode == 0 and "restarted" in r.stdout, r.stdout + r.stderr
    second = d.engine_pid()
    assert second != first and _gone(worker)  # the old engine's rank left with it
    assert _complete(d.url) == " better than never."

    (worker,) = tp_workers(second)
    worker.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    # The engine core (a process of its own, the ranks under it) ends with its rank; the engine's front starts a
    # new core and resumes what was in flight (engine/loop/): the supervisor has nothing to restart.
    replaced: list = []
    while time.monotonic() - killed < 120 and not replaced:
        replaced = [w for w in tp_workers(second) if w.pid != worker.pid]
        time.sleep(0.2)
    assert replaced, "no new rank under the engine after a rank died"
    assert _complete(d.url) == " better than never."
    recovered = time.monotonic() - killed
    assert d.engine_pid() == second
    assert d.status()["restarts"]["recent"][-1]["reason"] == "manual"  # no supervisor restart
    (last_worker,) = replaced
    assert "tensor-parallel rank 1" in d.log("engine.log") + d.opsctl("logs").stdout
    print(f"tp=2 under opsctl: manual restart ok; rank 1 SIGKILL -> a new engine core served in {recovered:.1f} s")
    r = d.opsctl("stop")
    assert r.returncode == 0 and _gone(last_worker)
