"""The engine's settings resolved once against the checkpoint (EngineConfig.resolve): a frozen value whose limits
are ints, read through to the settings it came from, which stay as they were given."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, ConfigError, EngineConfig, ResolvedConfig


def test_limits_are_filled_in_once_and_the_given_settings_are_left_alone():
    given = EngineConfig(device="cpu", max_num_seqs=64, block_size=32)
    resolved = given.resolve(4096)
    assert (resolved.max_model_len, resolved.max_num_batched_tokens, resolved.max_num_seqs) == (
        4096,
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
        64,
    )
    assert given.max_model_len is None and given.max_num_batched_tokens is None  # not rewritten mid-start
    assert resolved.block_size == 32 and resolved.resolved_device() == "cpu"  # everything else reads through
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.max_model_len = 8  # type: ignore[misc]
    again = pickle.loads(pickle.dumps(resolved))  # a tensor-parallel worker receives it pickled
    assert again == resolved and again.block_size == 32
    assert resolved.engine_config().max_model_len == 4096


def test_a_sliding_window_caps_the_context_and_a_limit_past_the_model_is_refused():
    assert EngineConfig().resolve(32768, sliding_window=4096).max_model_len == 4096
    with pytest.raises(ConfigError, match="--max-model-len 9000 exceeds the model's limit of 8192 tokens"):
        EngineConfig(max_model_len=9000).resolve(8192)
    with pytest.raises(ConfigError, match="smaller than --max-model-len"):
        EngineConfig(max_model_len=4096, max_num_batched_tokens=1024, enable_chunked_prefill=False).resolve(8192)
    unchunked = EngineConfig(max_model_len=16384, enable_chunked_prefill=False).resolve(32768)
    assert unchunked.max_num_batched_tokens == 16384
    assert EngineConfig(max_num_seqs=512, max_num_batched_tokens=128).resolve(4096).max_num_seqs == 128
    assert isinstance(EngineConfig().resolve(64), ResolvedConfig)


def test_the_supervisors_standby_flags_are_checked_not_ignored():
    with pytest.raises(ConfigError, match="--standby-spare describes a standby: it needs --standby-after PID"):
        EngineConfig(standby_spare=True)
    with pytest.raises(ConfigError, match="--standby-after must be >= 1"):
        EngineConfig(standby_after=0)
    assert EngineConfig(standby_after=123, standby_spare=True).standby_spare
