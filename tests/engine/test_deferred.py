"""Start-up work left for after serving begins (engine/runner/deferred.py) and when the engine core runs it: at
once while idle, under load paced to a share of the time (at least DEFERRED_GAP_S apart) after DEFERRED_AFTER_LOAD_S
except units that make steps faster, and a unit that writes KV blocks only while none is held (the prefix cache
emptied first).  Outputs are unchanged by it."""

from __future__ import annotations

import time

from engine.config import EngineConfig
from engine.core import engine_core
from engine.loop.llm_engine import LLMEngine
from engine.runner.deferred import DeferredWork, one_unit
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_jobs_run_unit_by_unit_in_order_and_report_when_done():
    work = DeferredWork()
    ran: list[str] = []

    def units(name: str, n: int):  # type: ignore[no-untyped-def]
        for i in range(n):
            ran.append(f"{name}{i}")
            yield

    done: list[str] = []
    work.add("a", units("a", 2), on_done=lambda: done.append("a"))
    work.add("b", one_unit(lambda: ran.append("b")), needs_idle=True)
    assert work.pending and not work.next_needs_idle
    assert [work.run_one() for _ in range(3)] == ["a", "a", "a"]  # the third finds the job exhausted
    assert ran == ["a0", "a1"] and done == ["a"] and work.next_needs_idle
    assert work.run_all() >= 0 and ran == ["a0", "a1", "b"] and not work.pending
    assert set(work.done) == {"a", "b"} and work.run_one() is None


def _outputs(engine: LLMEngine, tag: str) -> dict[str, list[int]]:
    for i, prompt in enumerate(["Beautiful is", "Errors should never", "Now is better than"]):
        engine.add_request(f"{tag}{i}", prompt, GREEDY)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id.removeprefix(tag)] = list(o.outputs[0].token_ids)
    return out


def test_the_core_runs_units_when_idle_between_steps_and_kv_writers_only_when_no_block_is_held(monkeypatch):
    engine = LLMEngine(EngineConfig(device="cpu", enable_prefix_caching=True))
    reference = _outputs(engine, "ref-")
    core = engine.core
    assert core.kv.pool.num_cached > 0  # the reference run left cached prefixes
    log: list[tuple[str, int, int]] = []

    def units(name: str, n: int):  # type: ignore[no-untyped-def]
        for _ in range(n):
            log.append((name, core.scheduler.num_running, core.kv.num_held_blocks()))
            yield

    work = core.runner.deferred
    work.add("graphs", units("graphs", 4))
    work.add("warm", units("warm", 1), needs_idle=True)
    monkeypatch.setattr(engine_core, "DEFERRED_GAP_S", 0.0)
    monkeypatch.setattr(engine_core, "DEFERRED_AFTER_LOAD_S", 3600.0)  # load first: the requests go first
    engine.run_deferred()  # idle: a unit at once
    assert [x[0] for x in log] == ["graphs"]
    assert _outputs(engine, "a-") == reference  # the deferred work changes no token
    assert [x[0] for x in log] == ["graphs"], "a unit ran under load before the engine had served its first steps"
    core._deferred_start, core._last_deferred = None, float("-inf")  # a new start under load, no unit yet
    monkeypatch.setattr(engine_core, "DEFERRED_AFTER_LOAD_S", 0.0)
    monkeypatch.setattr(engine_core, "DEFERRED_GAP_S", 3600.0)  # under load: at most one unit per hour
    assert _outputs(engine, "g-") == reference
    assert [x[0] for x in log] == ["graphs", "graphs"], "a second unit ran before its gap had passed"
    monkeypatch.setattr(engine_core, "DEFERRED_GAP_S", 0.0)
    for i, prompt in enumerate(["Beautiful is", "Errors should never"]):
        engine.add_request(f"b-{i}", prompt, GREEDY)
    engine.step()
    engine.step()
    assert [x[0] for x in log][:4] == ["graphs", "graphs", "graphs", "graphs"]
    assert all(held > 0 for name, _, held in log[1:] if name == "graphs"), "the units ran between steps of requests"
    while engine.has_unfinished_requests():
        engine.step()
    while work.pending:
        engine.run_deferred()
    warm = [x for x in log if x[0] == "warm"]
    assert warm == [("warm", 0, 0)], "the KV writer ran while blocks were held"
    assert core.kv.pool.num_cached == 0, "the prefix cache was emptied before the KV writer ran"
    assert _outputs(engine, "c-") == reference


def test_finish_deferred_runs_everything_now():
    engine = LLMEngine(EngineConfig(device="cpu"))
    ran = []
    engine.core.runner.deferred.add("x", one_unit(lambda: ran.append(time.monotonic())))
    engine.core.finish_deferred()
    assert len(ran) == 1 and not engine.core.has_deferred_work()


def test_units_that_speed_up_steps_run_under_load_at_once_and_the_rest_are_paced_by_their_length(monkeypatch):
    engine = LLMEngine(EngineConfig(device="cpu"))
    core = engine.core
    ran: list[str] = []

    def units(name: str, n: int, seconds: float = 0.0):  # type: ignore[no-untyped-def]
        for _ in range(n):
            ran.append(name)
            time.sleep(seconds)
            yield

    work = core.runner.deferred
    work.add("graphs", units("graphs", 2), speeds_up_steps=True)
    work.add("slow", units("slow", 3, 0.2))
    monkeypatch.setattr(engine_core, "DEFERRED_AFTER_LOAD_S", 3600.0)
    monkeypatch.setattr(engine_core, "DEFERRED_GAP_S", 0.0)
    for i, prompt in enumerate(["Beautiful is", "Errors should never"]):
        engine.add_request(f"s-{i}", prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert ran == ["graphs", "graphs"], "decode graphs wait for nothing; the rest waits for the first seconds of load"

    core._deferred_start = time.monotonic() - 1  # past the hold
    monkeypatch.setattr(engine_core, "DEFERRED_SHARE", 0.01)  # a 0.2 s unit: the next one 20 s later
    for i, prompt in enumerate(["Beautiful is", "Errors should never"]):
        engine.add_request(f"t-{i}", prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert ran.count("slow") == 1 and work.last_unit_seconds >= 0.2


def test_a_unit_run_while_idle_does_not_delay_the_first_unit_under_load(monkeypatch):
    """A restarted engine runs a unit in the moment before its queued requests arrive; the first unit under load
    (a decode graph) must not then wait out that unit's pacing (it did: 15 eager steps, 0.5 s, on an H100)."""
    engine = LLMEngine(EngineConfig(device="cpu"))
    ran: list[int] = []

    def units():  # type: ignore[no-untyped-def]
        for _ in range(3):
            ran.append(engine.core.stats.steps)
            time.sleep(0.1)
            yield

    engine.core.runner.deferred.add("graphs", units(), speeds_up_steps=True)
    monkeypatch.setattr(engine_core, "DEFERRED_AFTER_LOAD_S", 3600.0)
    engine.run_deferred()  # idle: one 0.1 s unit
    engine.add_request("r", "Beautiful is", GREEDY)
    engine.step()
    assert len(ran) == 2 and ran[1] == 1, "the first step under load ran no unit"
