"""A tensor-parallel server on CPU (2 gloo ranks, real processes): it serves, and a dead rank stops it.

The worker is killed with SIGKILL while a stream is running, the way the OOM killer or a driver
fault would: the engine must exit 1 within 10 s (so that a supervisor restarts it), never hang,
and its last line must say which rank failed and how.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.server.harness import tp_workers

pytestmark = pytest.mark.slow

MODEL = "pagekeeper-default"


def test_tp2_server_serves_then_exits_1_with_one_line_when_a_rank_dies(launch):
    server = launch("--tensor-parallel-size", "2", "--max-num-seqs", "8")
    (worker,) = tp_workers(server.proc.pid)
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Now is", "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " better than never."

    streamed: list[str] = []

    def stream() -> None:  # a request in flight when the rank dies: it must end, not hang
        body = {"model": MODEL, "prompt": "Beautiful is", "max_tokens": 200, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
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
