"""The weights keeper (engine/keeper/): weights loaded once, mapped by every engine it serves, never an outage.

On the CPU the handles are shared-memory file descriptors instead of CUDA IPC handles; everything else (the arena,
the protocol, the key, the attach, the fallbacks) is the code a GPU runs.  tests/kernels/test_keeper_gpu.py runs the
CUDA path on a GPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from structlog.testing import capture_logs

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.keeper.arena import export, materialize, open_shared, share, unique_tensors
from engine.keeper.client import KeptWeightsMismatch, attach, kept_model
from engine.keeper.protocol import request
from engine.model.loader import build_on_meta, fill_weights, inspect_model, load_model
from tests.server.harness import REPO

PROMPTS = ["Beautiful is", "Errors should never", "Now is better than"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def _info(**kw):
    return inspect_model(EngineConfig(device="cpu", **kw))


def test_an_arena_shared_and_opened_again_gives_the_same_model_bit_for_bit():
    info = _info()
    cpu = torch.device("cpu")
    kept = build_on_meta(info, 1, cpu)
    arena = materialize(kept, cpu, shared_cpu=True)
    fill_weights(kept, info, "auto", cpu)
    views, storages = export(kept, arena)
    assert len(storages) == 1, "every tensor lives in the one arena"
    handles, fds = share(storages)
    opened = open_shared(handles, [os.dup(fd) for fd in fds])
    engine_model = build_on_meta(info, 256, cpu)
    attach(engine_model, views, opened, cpu)
    reference = load_model(info, 256, cpu)
    ours, theirs = dict(engine_model.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
        assert p.untyped_storage().data_ptr() == opened[0].untyped_storage().data_ptr(), f"{name} is not shared"
    # buffers are the engine's own copies (an FP8 cache calibrates its scales in place)
    for name, b in engine_model.named_buffers():
        assert b.untyped_storage().data_ptr() != opened[0].untyped_storage().data_ptr(), name


def test_attach_refuses_weights_of_another_shape():
    info = _info()
    cpu = torch.device("cpu")
    kept = build_on_meta(info, 1, cpu)
    arena = materialize(kept, cpu)
    views, storages = export(kept, arena)
    other = inspect_model(EngineConfig(device="cpu", dtype="bfloat16"))
    with pytest.raises(KeptWeightsMismatch, match="float32"):
        attach(build_on_meta(other, 16, cpu), views, storages, cpu)
    first = views[0]
    with pytest.raises(KeptWeightsMismatch, match="has no"):
        attach(build_on_meta(info, 16, cpu), [v for v in views if v is not first], storages, cpu)


def test_tied_weights_stay_tied_after_attach():
    info = _info()
    cpu = torch.device("cpu")
    model = build_on_meta(info, 16, cpu)
    names = {n for n, _, _ in unique_tensors(model)}
    kept = build_on_meta(info, 1, cpu)
    arena = materialize(kept, cpu)
    fill_weights(kept, info, "auto", cpu)
    views, storages = export(kept, arena)
    attach(model, views, storages, cpu)
    assert {n for n, _, _ in unique_tensors(model)} == names
    assert not any(p.is_meta for p in model.parameters())


def _start_keeper(tmp_path, *flags: str):  # type: ignore[no-untyped-def]
    sock = tmp_path / "keeper.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.keeper", "--socket", str(sock), "--device", "cpu", *flags],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if request(sock, "state", 2.0)[0].get("state") == "ready":
                break
        except OSError:
            pass
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        time.sleep(0.1)
    else:
        pytest.fail("the keeper did not become ready in 120 s")
    return proc, sock


@pytest.fixture
def keeper(tmp_path):
    """A real keeper process serving the embedded model on the CPU."""
    proc, sock = _start_keeper(tmp_path)
    yield proc, sock
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def test_an_engine_takes_its_weights_from_the_keeper_and_answers_as_one_that_loaded_them(keeper):
    proc, sock = keeper
    shared = LLM(device="cpu", weights_keeper=str(sock))
    assert shared.llm_engine.core.phases.get("weights") is not None
    own = LLM(device="cpu")
    a = [o.outputs[0].token_ids for o in shared.generate(PROMPTS, GREEDY)]
    b = [o.outputs[0].token_ids for o in own.generate(PROMPTS, GREEDY)]
    assert a == b  # float32 (the kept layers' plain product against the packed one: the same greedy tokens)
    # the kept weights stay the keeper's one shared copy; an engine that loaded its own packs them (cpu_packing)
    kept_layer = shared.llm_engine.core.runner.model.model.layers[0].self_attn.qkv_proj
    own_layer = own.llm_engine.core.runner.model.model.layers[0].self_attn.qkv_proj
    assert not kept_layer.weight.is_mkldnn and own_layer.weight.is_mkldnn == torch.backends.mkldnn.is_available()
    reply = request(sock, "state", 2.0)[0]
    assert reply["state"] == "ready" and reply["pid"] == proc.pid


def _fallback_reasons(logs: list[dict]) -> list[str]:
    return [e["reason"] for e in logs if e["event"] == "engine_weights_from" and e.get("source") == "checkpoint"]


def test_weights_for_another_configuration_are_refused_and_the_engine_loads_its_own(keeper):
    _, sock = keeper
    config = EngineConfig(device="cpu", dtype="bfloat16", weights_keeper=str(sock))
    info = inspect_model(config)
    with capture_logs() as logs:
        assert kept_model(config, info, 64, torch.device("cpu")) is None
    assert any("key differs" in r for r in _fallback_reasons(logs))
    llm = LLM(device="cpu", dtype="bfloat16", weights_keeper=str(sock))  # still serves, from the checkpoint
    assert llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids


def test_a_dead_keeper_costs_a_cold_start_never_a_failure(keeper):
    proc, sock = keeper
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    started = time.monotonic()
    with capture_logs() as logs:
        llm = LLM(device="cpu", weights_keeper=str(sock))
    assert time.monotonic() - started < 60
    assert any("does not answer" in r for r in _fallback_reasons(logs))
    assert llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].text


def test_an_engine_waits_for_a_keeper_still_loading(tmp_path):
    """Started together (the supervisor's cold start), the engine waits for the keeper's load instead of loading a
    second copy beside it."""
    sock = tmp_path / "keeper.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.keeper", "--socket", str(sock), "--device", "cpu"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + 60
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        config = EngineConfig(device="cpu", weights_keeper=str(sock))
        kept = kept_model(config, inspect_model(config), 64, torch.device("cpu"))
        assert kept is not None and kept.keeper_pid == proc.pid
    finally:
        proc.kill()
        proc.wait(10)


def test_the_keeper_refuses_a_checkpoint_it_cannot_load_with_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    r = subprocess.run(
        [sys.executable, "-m", "engine.keeper", "--socket", str(tmp_path / "k.sock"), "--device", "cpu"]
        + ["--model", str(bad)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")


def test_every_rank_keeps_its_shard_in_the_models_dtype(tmp_path):
    """Four ranks loaded on four threads hold what one rank built alone holds, dtype for dtype (building once ran on
    the rank threads, and torch's default dtype is the process's: a 70B keeper once held one float32 tensor)."""
    from engine.keeper.server import Keeper
    from engine.parallel.group import TPGroup

    config = EngineConfig(device="cpu", dtype="bfloat16", tensor_parallel_size=4, load_format="dummy")
    keeper = Keeper(config, tmp_path / "k.sock")
    keeper.load()
    info = inspect_model(config)
    for rank in range(4):
        alone = build_on_meta(info, 1, torch.device("cpu"), TPGroup(rank, 4))
        expected = {name: str(t.dtype) for name, _, t in unique_tensors(alone)}
        kept = {v.name: str(v.dtype) for v in keeper.ranks[rank].views}
        assert kept == expected, rank
    assert torch.get_default_dtype() == torch.float32


def test_tensor_parallel_ranks_all_map_the_kept_weights_and_answer_as_one_loaded_engine(tmp_path):
    """At TP=2 every rank maps its shard from the keeper, the ranks agree on it (an all-reduce: one rank that
    could not would make them all load their own), and the answers equal an engine that loaded its weights."""
    own = LLM(device="cpu", tensor_parallel_size=2)
    expected = [o.outputs[0].token_ids for o in own.generate(PROMPTS, GREEDY)]
    own.close()
    proc, sock = _start_keeper(tmp_path, "--tensor-parallel-size", "2")
    try:
        with capture_logs() as logs:
            llm = LLM(device="cpu", tensor_parallel_size=2, weights_keeper=str(sock))
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert got == expected
        sources = [e for e in logs if e["event"] == "engine_weights_from"]
        assert sources and all(e["source"] == "keeper" for e in sources), sources
        llm.close()
    finally:
        proc.kill()
        proc.wait(10)
