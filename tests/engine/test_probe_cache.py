"""Start-up measurements on disk (engine/runner/probe_cache.py): a hit only under the same key, a miss said in
a log line, and a damaged or unwritable cache costs a measurement, never a start."""

from __future__ import annotations

import subprocess
import sys

import torch
from structlog.testing import capture_logs

from engine.config import EngineConfig
from engine.runner.probe_cache import ProbeCache

MODEL = {"hidden_size": 64, "num_hidden_layers": 2, "_name_or_path": "/somewhere"}


def _cache(tmp_path, **settings) -> ProbeCache:  # type: ignore[no-untyped-def]
    config = EngineConfig(device="cpu", max_model_len=256, max_num_batched_tokens=512, **settings)
    return ProbeCache(config, MODEL, "float32", "float32", torch.device("cpu"), 0, tmp_path)


def test_a_value_put_under_a_key_is_read_back_by_a_later_start_with_the_same_key(tmp_path):
    first = _cache(tmp_path)
    with capture_logs() as logs:
        assert first.get("profile") is None
    assert logs[0]["event"] == "probe_cache_miss" and logs[0]["reason"] == "no file for this key"
    first.put("profile", {"activation_bytes": 123})
    first.put("piece_buckets", [32, 64])
    again = _cache(tmp_path)
    assert again.key == first.key
    assert again.get("profile") == {"activation_bytes": 123} and again.get("piece_buckets") == [32, 64]


def test_settings_that_shape_a_step_the_rank_and_the_model_are_in_the_key(tmp_path):
    base = _cache(tmp_path).key
    assert _cache(tmp_path, max_num_seqs=8).key != base
    assert _cache(tmp_path, block_size=32).key != base
    assert _cache(tmp_path, enforce_eager=True).key != base
    config = EngineConfig(device="cpu", max_model_len=256, max_num_batched_tokens=512)
    other_rank = ProbeCache(config, MODEL, "float32", "float32", torch.device("cpu"), 1, tmp_path)
    assert other_rank.key != base
    other_model = ProbeCache(
        config, {**MODEL, "hidden_size": 128}, "float32", "float32", torch.device("cpu"), 0, tmp_path
    )
    assert other_model.key != base
    renamed = ProbeCache(config, {**MODEL, "_name_or_path": "/elsewhere"}, "float32", "float32", torch.device("cpu"))
    assert renamed.key == base  # where the checkpoint lies is not part of what was measured


def test_a_damaged_file_is_a_miss_and_an_unwritable_directory_only_a_warning(tmp_path):
    cache = _cache(tmp_path)
    cache.path.parent.mkdir(parents=True, exist_ok=True)
    cache.path.write_text("{not json")
    assert _cache(tmp_path).get("profile") is None
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    config = EngineConfig(device="cpu", max_model_len=256, max_num_batched_tokens=512)
    unwritable = ProbeCache(config, MODEL, "float32", "float32", torch.device("cpu"), 0, blocked / "sub")
    with capture_logs() as logs:
        unwritable.put("profile", {"activation_bytes": 1})
    assert logs[-1]["event"] == "probe_cache_unwritable"


CPU_KEY = """
import sys, torch
from engine.config import EngineConfig
from engine.runner.probe_cache import ProbeCache
cache = ProbeCache(EngineConfig(device="cpu", max_model_len=256, max_num_batched_tokens=512), {}, "float32",
                   "float32", torch.device("cpu"))
print(cache.parts["versions"], "triton" in sys.modules)
"""


def test_a_cpu_engine_s_key_does_not_import_triton():
    """Only the CUDA kernels depend on Triton; importing it for a CPU engine's key took 0.15 s of its start."""
    from tests.server.harness import REPO

    r = subprocess.run([sys.executable, "-c", CPU_KEY], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["{'torch':", f"'{torch.__version__}'}}", "False"], r.stdout
