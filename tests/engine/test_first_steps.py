"""The server's first steps, timed and logged once (engine/core/first_steps.py): what requests that waited through a
restart waited for next.  Offline engines log nothing."""

from __future__ import annotations

from structlog.testing import capture_logs

from engine.config import EngineConfig
from engine.core.first_steps import FirstSteps, step_kind
from engine.core.plan import SeqStep, StepPlan
from engine.loop.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _run(engine: LLMEngine, prompts: list[str]) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()


def test_step_kinds():
    def plan(*tokens: int) -> StepPlan:
        return StepPlan(seqs=[SeqStep(f"s{i}", 0, n, [0] * n) for i, n in enumerate(tokens)])

    assert step_kind(plan(1, 1)) == "decode"
    assert step_kind(plan(5, 7)) == "prefill"
    assert step_kind(plan(1, 7)) == "mixed"


def test_a_server_engine_logs_its_first_steps_once_and_an_offline_engine_none():
    server = LLMEngine(EngineConfig(device="cpu"), defer_startup_work=True)
    server.core.first_steps = FirstSteps(count=4)
    with capture_logs() as logs:
        _run(server, ["Beautiful is", "Errors should never"])
        _run(server, ["Now is better than"])
    events = [e for e in logs if e["event"] == "first_steps"]
    assert len(events) == 1, events
    steps = events[0]["steps"]
    assert events[0]["fields"] == ["kind", "seqs", "tokens", "deferred_units", "ms"]
    assert len(steps) == 4 and steps[0][0] == "prefill" and steps[0][1] == 2 and steps[-1][0] == "decode"
    assert all(s[4] > 0 for s in steps) and events[0]["slowest_ms"] == max(s[4] for s in steps)
    assert events[0]["seconds"] >= sum(s[4] for s in steps) / 1000 * 0.5

    offline = LLMEngine(EngineConfig(device="cpu"))
    with capture_logs() as logs:
        _run(offline, ["Beautiful is"] * 3)
    assert not [e for e in logs if e["event"] == "first_steps"]
