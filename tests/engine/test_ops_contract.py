"""engine/ops_contract/: one rule for which API/admin key an engine uses, shared by the engine and its supervisor
(the supervisor once preferred the config file's admin key over the environment's, the engine the reverse: its
probes would have failed with 401 when both were set), and the in-flight file and control client it holds."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from engine.config import ConfigError
from engine.ops_contract.inflight import InflightFile
from engine.ops_contract.secrets import SECRET_ENV, key_from_config


def _key_file(tmp_path, text: str = "from-key-file\n", mode: int = 0o600) -> str:
    path = tmp_path / "admin.key"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def test_the_environment_beats_the_files_key_and_a_key_file_stands_alone(tmp_path):
    env = {SECRET_ENV["admin_key"]: "from-env"}
    assert key_from_config("admin_key", {"admin_key": "from-file"}, env) == "from-env"
    assert key_from_config("admin_key", {"admin_key": "from-file"}, {}) == "from-file"
    assert key_from_config("admin_key", {}, {}) is None
    assert key_from_config("api_key", {"api_key_file": _key_file(tmp_path)}, {}) == "from-key-file"
    with pytest.raises(ConfigError, match="admin_key_file and admin_key .* both give the key"):
        key_from_config("admin_key", {"admin_key_file": _key_file(tmp_path)}, env)


def test_a_key_file_others_can_read_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="others can read the key"):
        key_from_config("admin_key", {"admin_key_file": _key_file(tmp_path, mode=0o644)}, {})


def test_the_supervisor_probes_with_the_key_the_engine_it_starts_uses(tmp_path, monkeypatch):
    """The engine's own parsing of the same file and environment, and the supervisor's, agree."""
    from engine.server.__main__ import parse_args
    from opsctl.supervisor import _admin_key

    config = tmp_path / "pagekeeper.toml"
    config.write_text('[engine]\nadmin_key = "from-file"\n')
    os.chmod(config, 0o600)
    monkeypatch.setenv(SECRET_ENV["admin_key"], "from-env")
    server, _ = parse_args(["--config", str(config)])
    assert server.admin_key == "from-env" == _admin_key(SimpleNamespace(engine={"admin_key": "from-file"}))
    monkeypatch.delenv(SECRET_ENV["admin_key"])
    server, _ = parse_args(["--config", str(config)])
    assert server.admin_key == "from-file" == _admin_key(SimpleNamespace(engine={"admin_key": "from-file"}))


def test_the_inflight_file_outlives_its_writer(tmp_path):
    path = tmp_path / "inflight"
    assert InflightFile.read(path) is None
    counter = InflightFile(path)
    counter.set(3)
    counter.set_aborted(1)
    del counter
    assert InflightFile.read(path) == (3, 1)
