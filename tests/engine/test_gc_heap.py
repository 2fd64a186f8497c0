"""The collector's full passes skip the engine's start-up heap (engine/gc_heap.py)."""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import sys
import threading
import time
import weakref

from engine import LLM, SamplingParams
from engine.gc_heap import frozen_heap
from tests.server.harness import REPO


class _Node:
    """A container the collector tracks, put in a reference cycle so that only a full collection frees it."""

    def __init__(self) -> None:
        self.me = self


def test_a_frozen_run_keeps_old_objects_from_the_collector_and_hands_them_back_after() -> None:
    assert gc.get_freeze_count() == 0
    dropped = _Node()
    alive = weakref.ref(dropped)
    with frozen_heap():
        frozen = gc.get_freeze_count()
        del dropped  # the caller lets go of it mid-run: only the collector can free a cycle
        gc.collect()
        kept_during_run = alive() is not None
    gc.collect()
    print(f"objects frozen during the run: {frozen}; the dropped cycle freed after it: {alive() is None}")
    assert frozen > 1000
    assert kept_during_run  # frozen: a full pass did not walk it
    assert alive() is None  # not leaked: the run gave it back
    assert gc.get_freeze_count() == 0


def test_overlapping_runs_unfreeze_when_the_last_one_ends() -> None:
    inside, release = threading.Event(), threading.Event()

    def second_run() -> None:
        with frozen_heap():
            inside.set()
            release.wait(30)

    t = threading.Thread(target=second_run)
    with frozen_heap():
        t.start()
        assert inside.wait(30)
    frozen_after_first = gc.get_freeze_count()
    release.set()
    t.join(30)
    assert frozen_after_first > 0  # the other run still goes on: its heap stays frozen
    assert gc.get_freeze_count() == 0


def test_offline_generate_runs_with_the_heap_frozen() -> None:
    """Every collection during `generate` sees the start-up heap frozen (but one that the call itself may set off
    before its first line); none after it does."""
    seen: list[int] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(gc.get_freeze_count())

    llm = LLM()
    threshold = gc.get_threshold()
    gc.set_threshold(50)  # a young collection every 50 allocations: a short run meets several
    gc.callbacks.append(on_gc)
    try:
        out = llm.generate(["Beautiful is"] * 8, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    finally:
        gc.callbacks.remove(on_gc)
        gc.set_threshold(*threshold)
    print(f"collections during generate: {len(seen)}, frozen objects in each: {seen[1:2]}-{max(seen, default=0)}")
    assert [len(o.outputs[0].token_ids) for o in out] == [24] * 8
    assert len(seen) > 5 and min(seen[1:]) > 10_000
    assert gc.get_freeze_count() == 0
    llm.close()


FULL_PASS = """
import gc, time
import torch, transformers  # the heap an engine process carries: torch's and transformers' modules
from engine.gc_heap import freeze_startup_heap

def full_pass_ms():
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter(); gc.collect(); best = min(best, time.perf_counter() - t)
    return 1e3 * best

before = full_pass_ms()
frozen = freeze_startup_heap()
after = full_pass_ms()
print(frozen, round(before, 2), round(after, 2), len(gc.get_objects()))
"""


def test_a_serving_process_freezes_its_start_up_heap_and_full_passes_get_short() -> None:
    r = subprocess.run([sys.executable, "-c", FULL_PASS], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    frozen, before, after, left = r.stdout.split()
    print(f"frozen {frozen} objects; a full pass {before} ms before, {after} ms after; {left} objects left tracked")
    assert int(frozen) > 50_000
    assert float(after) < float(before) / 5


def test_a_paused_collector_comes_back_with_the_freeze_and_a_disabled_one_stays_off() -> None:
    from engine import gc_heap

    assert gc.isenabled()
    try:
        gc_heap.pause_startup_collections()
        assert not gc.isenabled()
        gc_heap.resume_startup_collections()
        assert gc.isenabled()
        gc.disable()  # the caller's own choice: neither pausing nor resuming changes it
        gc_heap.pause_startup_collections()
        gc_heap.resume_startup_collections()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_imported_heap_is_frozen_only_in_a_process_that_paused_its_collector() -> None:
    from engine import gc_heap

    assert gc_heap.freeze_imported_heap() == 0 and gc.get_freeze_count() == 0  # the offline API's caller: untouched
    gc_heap.pause_startup_collections()
    try:
        assert gc_heap.freeze_imported_heap() > 1000
    finally:
        gc.unfreeze()
        gc_heap.resume_startup_collections()
    assert gc.isenabled()


def test_a_server_start_that_fails_gives_the_collector_back() -> None:
    from engine.server.__main__ import main

    assert main(["--model", "/nonexistent/model"]) == 2
    assert gc.isenabled()


SERVER_COLLECTIONS = """
import atexit, gc, json, runpy, sys
events = []
def seen(phase, info):
    if phase == "start":  # a collection while the collector is disabled is an explicit gc.collect()
        events.append([info["generation"], gc.get_freeze_count(), gc.isenabled()])
gc.callbacks.append(seen)
atexit.register(lambda: print("COLLECTIONS " + json.dumps({"events": events, "enabled": gc.isenabled()}), flush=True))
sys.argv = ["engine.server", "--port", sys.argv[1], "--engine-core", "thread"]  # the heap of a one-process server
runpy.run_module("engine.server", run_name="__main__")
"""


def _wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 120) -> None:  # type: ignore[type-arg]
    """Until the server on `port` answers /health with 200, it exits, or `timeout` passes."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)


def test_a_server_start_runs_no_automatic_collection_until_its_heap_is_frozen(tmp_path) -> None:
    """Before the freeze the collector ran hundreds of passes over the growing start-up heap (4 of them full,
    0.64 s of CPU in all); now the freeze's own full pass is the only one after the server's first line, it does
    not walk the imported modules, and the collector works again afterwards."""

    from tests.server.harness import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_COLLECTIONS, str(port)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        _wait_healthy(proc, port)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    report = json.loads(next(ln for ln in out.splitlines() if ln.startswith("COLLECTIONS "))[len("COLLECTIONS ") :])
    explicit = [(g, frozen) for g, frozen, enabled in report["events"] if not enabled]
    first = next(i for i, (_, _, enabled) in enumerate(report["events"]) if not enabled)
    automatic = [g for g, _, _ in report["events"][:first]]
    print(f"before the freeze: automatic collections {automatic}; the freeze's pass {explicit}")
    # what runs before the server's first line (the interpreter, runpy, the engine package) may collect young objects
    assert all(g == 0 for g in automatic) and len(automatic) < 10
    # freeze_startup_heap's own pass, the only one while paused, walks what the engine built: the imported modules
    # (some 300,000 objects with torch's) were frozen before it (freeze_imported_heap)
    [(generation, frozen_then)] = explicit
    assert generation == 2 and frozen_then > 100_000
    assert report["enabled"]


def test_the_engine_core_process_freezes_its_start_up_heap_too(tmp_path) -> None:
    """The engine core's own process (`--engine-core process`) holds the model and the KV pool: it pauses its
    collector while it starts and freezes what it built, as a one-process server does."""

    from tests.server.harness import free_port

    port = free_port()
    log_path = tmp_path / "engine.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.server", "--port", str(port), "--engine-core", "process"],
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_healthy(proc, port)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    ready = [json.loads(ln) for ln in log_path.read_text().splitlines() if '"core_ready"' in ln]
    assert len(ready) == 1, log_path.read_text()[-3000:]
    assert ready[0]["pid"] != proc.pid
    assert ready[0]["heap_frozen"] > 100_000  # the imported modules (torch's) and what the engine built
