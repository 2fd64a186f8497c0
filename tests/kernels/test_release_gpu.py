"""A leaving engine frees its device memory before its exit (engine/runner/release.py): after the release its
allocator holds no more than the slack, so its successor may stop waiting for it.  Off CUDA nothing happens."""

from __future__ import annotations

import gc

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runner.release import RELEASE_SLACK_BYTES, release_for_successor


@pytest.fixture(autouse=True)
def _device_memory_freed_after_each_test():
    """An engine a test leaves behind keeps its KV cache in torch's caching allocator, and the next test's engine
    counts it as another process's memory: on an H200, 0.3 of the device (42 GiB) left 0 blocks for the next one."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


def test_a_leaving_runner_drops_its_swap_space():
    """The swap space is unpinned by the leaving process, not by its exit's teardown (release.py's docstring)."""
    from types import SimpleNamespace

    from engine.runner.release import release_pinned_memory
    from engine.runner.swap_space import SwapSpace

    swap = SwapSpace((2, 8), torch.float32, layers=4, pin=False, background=False)
    blocks = swap.tensors()
    assert release_pinned_memory(SimpleNamespace(swap=swap)) == 4 * 2 * 8 * 4  # type: ignore[arg-type]
    assert blocks == []


@pytest.mark.gpu
def test_a_released_cuda_runner_unpins_its_swap_space(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEKEEPER_CACHE_DIR", str(tmp_path))
    llm = LLM(
        str(checkpoint("llama")),
        device="cuda",
        dtype="bfloat16",
        max_model_len=256,
        gpu_memory_utilization=0.5,
        swap_space=0.25,
        preemption_mode="swap",
    )
    llm.generate(["hello"] * 2, SamplingParams(max_tokens=4), use_tqdm=False)
    runner = llm.llm_engine.core.runner
    runner.deferred.run_all()  # the cold start's swap_space job: every layer pinned
    blocks = runner.cpu_caches
    assert blocks and all(b.is_pinned() for b in blocks)
    assert release_for_successor(runner) is True
    assert blocks == []


@pytest.mark.gpu
def test_sequences_swapped_through_the_registered_swap_space_keep_their_tokens(checkpoint, tmp_path, monkeypatch):
    """Under KV pressure on the GPU, preempted sequences go to the page-locked huge-page blocks and come back: the
    tokens equal an unpressured run's (float32: greedy equality means something)."""
    import random

    monkeypatch.setenv("PAGEKEEPER_CACHE_DIR", str(tmp_path))
    path = str(checkpoint("llama"))
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(4, 200) for _ in range(rng.randrange(5, 40))]} for _ in range(10)]
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    relaxed = LLM(path, device="cuda", dtype="float32", block_size=16, max_model_len=128, gpu_memory_utilization=0.3)
    want = [o.outputs[0].token_ids for o in relaxed.generate(prompts, p, use_tqdm=False)]
    per_block = (
        relaxed.llm_engine.core.runner.kv_caches[0][:, 0].numel() * 4 * len(relaxed.llm_engine.core.runner.kv_caches)
    )
    relaxed.close()
    del relaxed
    gc.collect()
    torch.cuda.empty_cache()  # the tight engine's budget must not count the relaxed one's cache
    tight = LLM(
        path,
        device="cuda",
        dtype="float32",
        block_size=16,
        max_model_len=80,
        kv_cache_memory_bytes=7 * per_block,
        preemption_mode="swap",
        swap_space=(64 * per_block) / 2**30,
    )
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, p, use_tqdm=False)]
    core = tight.llm_engine.core
    assert core.scheduler.num_preemptions > 0 and core.kv.blocks_swapped_out > 0
    assert all(b.is_pinned() for b in core.runner.cpu_caches)  # registered in place, seen as pinned by torch
    assert got == want


@pytest.mark.gpu
def test_a_refused_registration_leaves_no_error_for_the_next_kernel():
    """Registering pages twice is refused (cudaErrorHostMemoryAlreadyRegistered); the runtime's last error is read
    back at once, so torch's check after the next launch does not raise it (an engine's first step did)."""
    from engine.runner.pinned_host import HUGE_PAGE, HostRegion

    region = HostRegion(HUGE_PAGE)
    piece = region.pin(0, HUGE_PAGE)
    with pytest.raises(RuntimeError, match="cudaError 712"):
        region.pin(0, HUGE_PAGE)
    assert float((torch.ones(4, device="cuda") + 1).sum()) == 8.0
    del piece
    region.release()


@pytest.mark.gpu
def test_engines_made_one_after_another_in_one_process_pin_their_swap_space(checkpoint):
    """The second engine's swap space may be mapped where the first's was: the first's pages are unlocked on close."""
    for _ in range(3):
        llm = LLM(str(checkpoint("llama")), device="cuda", max_model_len=256, gpu_memory_utilization=0.3, swap_space=1)
        runner = llm.llm_engine.core.runner
        runner.deferred.run_all()  # the swap space pinned
        assert not runner.swap._region_refused, "the swap space fell back to torch's pinned allocator"
        llm.generate(["hello"] * 2, SamplingParams(max_tokens=4), use_tqdm=False)
        llm.close()
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()  # the next engine's budget must not count this one's memory
