"""The engine thread: everything submitted runs on one thread, in order (the engine's build and its step loop share
the thread, so torch keeps one OpenMP pool); results and exceptions come back to the caller; the thread is a daemon
(a step loop still running never holds the process open at exit); `running` tells a live loop from a finished or
failed one (what the health check reads)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from engine.loop.engine_thread import EngineThread


def test_jobs_run_in_order_on_one_daemon_thread_and_return_their_results() -> None:
    worker = EngineThread(name="engine-test")
    seen: list[tuple[int, int]] = []
    futures = [worker.submit(lambda i=i: seen.append((i, threading.get_ident())) or i * i) for i in range(20)]
    assert [f.result(timeout=10) for f in futures] == [i * i for i in range(20)]
    assert [i for i, _ in seen] == list(range(20))
    assert {ident for _, ident in seen} == {worker.ident} and worker.ident != threading.get_ident()
    thread = next(t for t in threading.enumerate() if t.ident == worker.ident)
    assert thread.daemon and thread.name == "engine-test"


def test_an_exception_reaches_the_caller_and_the_thread_goes_on() -> None:
    worker = EngineThread()
    with pytest.raises(ValueError, match="bad checkpoint"):
        worker.call(lambda: (_ for _ in ()).throw(ValueError("bad checkpoint")))
    assert worker.call(lambda: 7) == 7


def test_running_follows_a_long_job() -> None:
    worker = EngineThread()
    release = threading.Event()
    loop = worker.submit(release.wait)
    assert worker.running(loop)
    release.set()
    loop.result(timeout=10)
    assert not worker.running(loop)
    failed = worker.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=10)
    assert not worker.running(failed)


def test_a_loop_still_running_does_not_hold_the_process_open() -> None:
    code = (
        "import threading\n"
        "from engine.loop.engine_thread import EngineThread\n"
        "EngineThread().submit(threading.Event().wait)\n"
        "print('main done')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "main done" in r.stdout, r.stderr


def test_a_step_loop_that_raises_is_logged_and_reads_stalled() -> None:
    """Run on the engine thread, the loop's exception lands in a future: it must still reach the log with its
    traceback, and health must read "stalled" (what the supervisor and systemd restart on).  The log is read with
    structlog's own capture: the stream its logger factory holds is whatever stderr was when logging was configured
    (in a full run, an earlier test's capture), so capturing fd 2 here saw nothing."""
    import time

    from structlog.testing import capture_logs

    from engine import LLM
    from engine.loop.async_engine import AsyncEngine
    from engine.server.metrics import EngineMetrics

    llm = LLM(max_model_len=128)
    engine = AsyncEngine(llm.llm_engine, EngineMetrics("t", {}, 0, names="vllm", max_model_len=128))
    engine.add_loop_hook(lambda: [][1])  # an IndexError on the loop's first iteration
    with capture_logs() as logged:
        engine.start()
        deadline = time.monotonic() + 10
        while engine.health() != "stalled" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.health() == "stalled"
        # The future reads done (health: stalled) a moment before its done-callback logs.
        while not any(e["event"] == "step_loop_died" for e in logged) and time.monotonic() < deadline + 10:
            time.sleep(0.05)
    died = next(e for e in logged if e["event"] == "step_loop_died")
    print(died)
    assert died["log_level"] == "error" and died["error"] == "IndexError: list index out of range"
    assert isinstance(died["exc_info"], IndexError) and died["exc_info"].__traceback__ is not None
