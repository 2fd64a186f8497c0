"""A tensor-parallel server on CPU (2 gloo ranks, real processes): it serves, and a dead rank stops it.

The worker is killed with SIGKILL while a stream is running, the way the OOM killer or a driver
fault would: the engine must exit 1 within 10 s (so that a supervisor restarts it), never hang,
and its last line must say which rank failed and how.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.server.harness import tp_workers

pytestmark = pytest.mark.slow

MODEL = "pagekeeper-default"


def _kill_rank_under_a_stream(url: str, worker: psutil.Process, timeout: float) -> tuple[threading.Thread, list[str]]:
    """Start a 200-token stream (its usage included), SIGKILL `worker` once a few lines arrived; the client's thread
    and the lines it reads (an HTTP error ends them as "error: NAME")."""
    streamed: list[str] = []
    body = {"model": MODEL, "prompt": "Beautiful is", "max_tokens": 200, "stream": True, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}

    def stream() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as resp:
                for line in resp.iter_lines():
                    streamed.append(line)
        except httpx.HTTPError as e:
            streamed.append(f"error: {type(e).__name__}")

    client = threading.Thread(target=stream)
    client.start()
    deadline = time.monotonic() + 30
    while len(streamed) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.send_signal(signal.SIGKILL)
    return client, streamed


def test_tp2_server_serves_then_exits_1_with_one_line_when_a_rank_dies(launch):
    """One process (--engine-core thread): the engine is rank 0, and ends with its rank."""
    server = launch("--tensor-parallel-size", "2", "--max-num-seqs", "8", "--engine-core", "thread")
    (worker,) = tp_workers(server.proc.pid)
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Now is", "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " better than never."

    client, streamed = _kill_rank_under_a_stream(server.url, worker, timeout=30)  # the stream must end, not hang
    killed = time.monotonic()
    code = server.proc.wait(timeout=30)
    seconds = time.monotonic() - killed
    client.join(timeout=30)
    last = server.log().strip().splitlines()[-1]
    print(f"rank 1 SIGKILL -> engine exit {code} in {seconds:.2f} s; stream got {len(streamed)} lines; last: {last}")
    assert code == 1 and seconds < 10
    assert last == (
        f"pagekeeper engine: tensor-parallel rank 1 (pid {worker.pid}) failed: killed by signal 9; "
        "the engine stops (exit 1)"
    )
    assert not client.is_alive()
    assert not psutil.pid_exists(worker.pid) or psutil.Process(worker.pid).status() == psutil.STATUS_ZOMBIE


def test_tp2_split_server_resumes_its_requests_on_a_new_core_when_a_rank_dies(launch):
    """The default (--engine-core process): the core, rank 0 with its ranks under it, ends with its rank in one
    line; the front starts a new core and the stream in flight finishes, all its tokens there."""
    server = launch("--tensor-parallel-size", "2", "--max-num-seqs", "8")
    (worker,) = tp_workers(server.proc.pid)
    client, streamed = _kill_rank_under_a_stream(server.url, worker, timeout=120)
    client.join(timeout=120)
    assert not client.is_alive()
    usage = [u for u in (json.loads(ln[6:]).get("usage") for ln in streamed if ln.startswith("data: {")) if u]
    lines = [ln for ln in streamed if ln]
    assert lines[-1] == "data: [DONE]" and not any(ln.startswith("error") for ln in lines), lines[-3:]
    assert usage and usage[-1]["completion_tokens"] == 200, usage[-1:]
    assert server.proc.poll() is None
    assert f"tensor-parallel rank 1 (pid {worker.pid}) failed: killed by signal 9" in server.log()
    assert [w for w in tp_workers(server.proc.pid) if w.pid != worker.pid], "no new rank under the new core"


def test_tp2_server_stopped_exits_0_after_its_rank_and_skips_the_groups_teardown(launch):
    """A stop (SIGTERM) ends the rank at once and the engine after it (a restart's successor waits for the engine's
    exit, which must come after every rank's device memory is free), without NCCL's orderly leave (6.9 s at TP=4)."""
    server = launch("--tensor-parallel-size", "2", "--max-num-seqs", "8")
    (worker,) = tp_workers(server.proc.pid)
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Now is", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200
    worker_gone: list[float] = []
    watcher = threading.Thread(target=lambda: (worker.wait(60), worker_gone.append(time.monotonic())))
    watcher.start()
    stopped = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(timeout=60)
    engine_gone = time.monotonic()
    watcher.join(timeout=60)
    rank_s, engine_s = worker_gone[0] - stopped, engine_gone - stopped
    print(f"SIGTERM -> rank 1 gone in {rank_s:.2f} s, engine exit {code} in {engine_s:.2f} s")
    assert code == 0 and worker_gone and worker_gone[0] <= engine_gone
    assert "tp_group_leave" not in server.log()
