"""opsctl/bytecode.py: engines whose installation keeps no compiled bytecode and may not write any get a bytecode
folder under the cache folder, which a real second interpreter then reads instead of compiling again."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from opsctl import bytecode
from opsctl.bytecode import bytecode_plan


@pytest.fixture
def module(tmp_path, monkeypatch):
    """A package `pkprobe` installed from sources with no bytecode beside them."""
    site = tmp_path / "site"
    (site / "pkprobe").mkdir(parents=True)
    (site / "pkprobe" / "__init__.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return site


def test_no_bytecode_and_no_writing_gets_a_folder_under_the_cache(module, tmp_path):
    env = {"PYTHONDONTWRITEBYTECODE": "1", "PAGEKEEPER_CACHE_DIR": str(tmp_path / "cache")}
    plan = bytecode_plan(env, "auto", "pkprobe")
    assert plan.env == {"PYTHONPYCACHEPREFIX": str(tmp_path / "cache" / "bytecode"), "PYTHONDONTWRITEBYTECODE": ""}
    assert "PYTHONDONTWRITEBYTECODE is set" in plan.reason

    # a real interpreter with that environment compiles once into the folder, and nothing beside the sources
    run_env = {**env, **plan.env, "PYTHONPATH": str(module)}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", "import pkprobe; assert pkprobe.VALUE == 42"], env=run_env, check=True)
    assert list((tmp_path / "cache" / "bytecode").rglob("pkprobe/__pycache__/__init__.*.pyc")) or list(
        (tmp_path / "cache" / "bytecode").rglob("pkprobe/__init__.*.pyc")
    )
    assert not (module / "pkprobe" / "__pycache__").exists()


def test_a_read_only_installation_counts_as_no_writing(module, tmp_path, monkeypatch):
    monkeypatch.setattr(bytecode.os, "access", lambda path, mode: False)
    plan = bytecode_plan({"PAGEKEEPER_CACHE_DIR": str(tmp_path)}, "auto", "pkprobe")
    assert plan.env["PYTHONPYCACHEPREFIX"] == str(tmp_path / "bytecode") and "read-only" in plan.reason


def test_the_environment_is_left_alone_where_bytecode_exists_or_the_operator_chose(module, tmp_path):
    no_writes = {"PYTHONDONTWRITEBYTECODE": "1"}
    assert bytecode_plan(no_writes, "off", "pkprobe").env == {}
    assert bytecode_plan({**no_writes, "PYTHONPYCACHEPREFIX": "/mine"}, "auto", "pkprobe").env == {}
    assert bytecode_plan({}, "auto", "pkprobe").env == {}  # the first engine writes it beside the sources
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(module)], check=True)
    plan = bytecode_plan(no_writes, "auto", "pkprobe")
    assert plan.env == {} and "beside its sources" in plan.reason
    assert bytecode_plan(no_writes, "auto", "no_such_module_here").env == {}


def test_the_config_key_is_checked(tmp_path):
    from engine.config import ConfigError
    from opsctl.config import load_config

    path = tmp_path / "p.toml"
    path.write_text('[supervisor]\nbytecode_cache = "sometimes"\n')
    with pytest.raises(ConfigError, match="bytecode_cache"):
        load_config(path)
    path.write_text('[supervisor]\nbytecode_cache = "off"\n')
    assert load_config(path).supervisor.bytecode_cache == "off"
