"""A leaving engine frees its device memory before its exit (engine/runner/release.py): after the release its
allocator holds no more than the slack, so its successor may stop waiting for it.  Off CUDA nothing happens."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runner.release import RELEASE_SLACK_BYTES, release_for_successor


def test_a_cpu_runner_announces_nothing(tmp_path, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setenv("PAGEKEEPER_CACHE_DIR", str(tmp_path))
    assert release_for_successor(SimpleNamespace(device=torch.device("cpu"))) is False  # type: ignore[arg-type]
    assert not (tmp_path / "released").exists()


@pytest.mark.gpu
def test_a_released_runner_holds_less_than_the_slack_and_announces_it(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEKEEPER_CACHE_DIR", str(tmp_path))
    llm = LLM(str(checkpoint("llama")), device="cuda", dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.5)
    llm.generate(["hello"] * 4, SamplingParams(max_tokens=8), use_tqdm=False)  # graphs and cache in use
    runner = llm.llm_engine.core.runner
    runner.deferred.run_all()  # every graph captured: the most a runner holds
    before = torch.cuda.memory_reserved()
    assert before > 4 * RELEASE_SLACK_BYTES  # half the GPU's memory is its KV cache
    assert release_for_successor(runner) is True
    assert torch.cuda.memory_reserved() <= RELEASE_SLACK_BYTES
    assert len(list((tmp_path / "released").iterdir())) == 1
