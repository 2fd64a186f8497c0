"""One schema for the engine's settings, however they are given: a flag, a config file's key or a keyword argument
is refused by the same check in the same words (the file's told in its keys); the file reaches the engine as the
checked file, never as flags built from it; values derived from the settings are derived once, in ResolvedConfig."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import ConfigError, EngineConfig
from engine.default_model import DEFAULT_MODEL_DIR
from engine.server.__main__ import parse_args
from engine.server.config_file import in_config_terms, load_engine_section
from tests.server.harness import REPO

KV_CACHE_FP8 = "float8_e4m3fn"

# (flag, TOML key = value): each a mistake one of the schema's checks refuses
MISTAKES = [
    (["--block-size", "12"], "block_size = 12"),  # a choice (argparse refused the flag with a usage block)
    (["--kv-cache-dtype", "int8"], 'kv_cache_dtype = "int8"'),  # a choice (pydantic's words in the file)
    (["--max-num-seqs", "0"], "max_num_seqs = 0"),  # a range
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization = 1.5"),
    (["--port", "0"], "port = 0"),  # a server key
    (["--log-level", "verbose"], 'log_level = "verbose"'),
    (["--engine-core", "thread", "--max-resumes", "5"], 'engine_core = "thread"\nmax_resumes = 5'),  # a combination
    (["--tensor-parallel-overlap-tokens", "64"], "tensor_parallel_overlap_tokens = 64"),
]


@pytest.mark.parametrize("flags,toml", MISTAKES, ids=[m[1].split(" =")[0] for m in MISTAKES])
def test_a_flag_and_a_file_key_are_refused_by_the_same_check_in_the_same_words(tmp_path, flags, toml):
    with pytest.raises(ConfigError) as by_flag:
        parse_args(flags)
    config = tmp_path / "pagekeeper.toml"
    config.write_text(f"[engine]\n{toml}\n")
    with pytest.raises(ConfigError) as by_file:
        load_engine_section(config)
    values = load_values(toml)
    print(f"{by_flag.value}\n{by_file.value}")
    assert "\n" not in str(by_flag.value) and flags[0] in str(by_flag.value)
    assert str(by_file.value) == f"{config.resolve()}: {in_config_terms(str(by_flag.value), values)}"
    if toml.count("\n") == 0:  # one key: the offline API's keyword says the flag's words too
        with pytest.raises(ConfigError) as by_keyword:
            EngineConfig.from_kwargs(**values)
        if next(iter(values)) in EngineConfig.field_names():
            assert str(by_keyword.value) == str(by_flag.value)


def load_values(toml: str) -> dict:
    import tomllib

    return tomllib.loads(toml)


def test_a_bad_choice_on_the_command_line_is_one_line_and_exit_2():
    """argparse refused `--block-size 12` with its usage block (three lines); the schema says it in one."""
    for flags in (["--block-size", "12"], ["--metrics-names", "prometheus"], ["--dtype", "fp8"]):
        r = subprocess.run(
            [sys.executable, "-m", "engine.server", *flags],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=str(REPO),
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        print(r.stderr.strip())
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: {flags[0]} must be")


def test_the_supervisor_hands_its_engines_the_checked_section_as_a_file_not_as_flags(tmp_path, monkeypatch):
    """opsctl's engines read what the supervisor checked with `--config` (one serialisation, read by the same
    function and schema as the systemd unit's file); only what `opsctl start` itself took as flags stays a flag.
    The file's API key reaches the engine by the engine's own rule (the environment's wins), which the supervisor's
    probes follow: the engine's environment no longer carries the file's key over the supervisor's."""
    from engine.ops_contract.secrets import key_from_config
    from opsctl.config import load_config

    source = tmp_path / "pagekeeper.toml"
    source.write_text(
        f'[engine]\nmodel = "{DEFAULT_MODEL_DIR}"\nmax_model_len = 128\nenable_prefix_caching = true\n'
        'block_size = 32\napi_key = "from-the-file"\nport = 8123\n'
    )
    source.chmod(0o600)
    monkeypatch.setenv("PAGEKEEPER_API_KEY", "from-the-environment")
    cfg = load_config(source, {"engine": {"port": 9001}})
    section = tmp_path / "run" / "engine.toml"
    section.parent.mkdir(mode=0o700)
    command_line = cfg.engine_command_line(section)
    assert command_line == ["--config", str(section), "--port", "9001"]  # no flag built from the file's keys
    assert os.stat(section).st_mode & 0o777 == 0o600  # it holds a key
    assert load_engine_section(section) == {k: v for k, v in cfg.engine.items() if k != "port"}
    server, engine = parse_args(command_line)
    assert (engine.max_model_len, engine.enable_prefix_caching, engine.block_size) == (128, True, 32)
    assert server.port == 9001 and engine.model == str(DEFAULT_MODEL_DIR)
    assert server.api_key == "from-the-environment" == key_from_config("api_key", cfg.engine)
    assert not hasattr(cfg, "engine_args") and not hasattr(cfg, "engine_env")


def test_derived_values_are_resolved_once_into_the_resolved_config():
    """--kv-cache-dtype (a string) becomes the cache's storage dtype once, by name, beside the preemption mode and
    the swap space's bytes; the runner, the memory plan and `opsctl doctor` read those fields."""
    import torch

    from engine.runner.kv_scales import kv_cache_dtype

    fp8 = EngineConfig(kv_cache_dtype="fp8_e4m3").resolve(4096, model_dtype="bfloat16", device="cuda")
    plain = EngineConfig(swap_space=2).resolve(4096, model_dtype="bfloat16", device="cuda")
    on_cpu = EngineConfig(swap_space=2).resolve(4096, model_dtype="float32", device="cpu")
    told = EngineConfig(swap_space=2, preemption_mode="recompute").resolve(4096, model_dtype="float16", device="cuda")
    assert (fp8.kv_dtype, plain.kv_dtype, on_cpu.kv_dtype) == (KV_CACHE_FP8, "bfloat16", "float32")
    assert kv_cache_dtype(fp8) is torch.float8_e4m3fn and kv_cache_dtype(plain) is torch.bfloat16
    assert (plain.preemption_mode, plain.swap_space_bytes) == ("swap", 2 * 2**30)
    assert (on_cpu.preemption_mode, on_cpu.swap_space_bytes) == ("recompute", 0)
    assert (told.preemption_mode, told.swap_space_bytes) == ("recompute", 0)
    assert fp8.settings.kv_cache_dtype == "fp8_e4m3"  # the setting as given, for the metrics' label


def test_an_engine_stores_its_kv_cache_in_the_resolved_dtype():
    from engine import LLM

    with LLM(None, kv_cache_dtype="fp8", max_model_len=64, max_num_seqs=4) as llm:
        core = llm.llm_engine.core
        assert core.config.kv_dtype == KV_CACHE_FP8 == core.kv_plan.kv_dtype
        assert {t.dtype for t in core.runner.kv_caches} == {__import__("torch").float8_e4m3fn}


def test_the_keeper_reads_the_same_command_line_as_the_engine(tmp_path):
    """`python -m engine.keeper` takes the engine's command line (`--config FILE`, the engine's flags over it), so a
    mistake in the file is refused by the same schema; it exits 2 before loading anything."""
    section = tmp_path / "engine.toml"
    section.write_text("[engine]\nmax_num_seqs = 0\nport = 8000\n")
    r = subprocess.run(
        [sys.executable, "-m", "engine.keeper", "--socket", str(tmp_path / "k.sock"), "--config", str(section)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO),
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 2 and "--max-num-seqs must be >= 1, got 0" in r.stderr, r.stderr
    assert Path(section).exists()
