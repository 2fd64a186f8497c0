"""The runtime dir is trusted only when it is private: a symlinked log, a dir others can write to, or one
that belongs to another user is refused with one line (exit 2), and nothing is written through it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.server.harness import REPO, free_port


def _start(tmp_path, runtime):  # type: ignore[no-untyped-def]
    cfg = tmp_path / "p.toml"
    cfg.write_text(f'[engine]\nport = {free_port()}\n[supervisor]\nmetrics_port = 0\nlauncher = "process"\n')
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "opsctl.cli",
            "--config",
            str(cfg),
            "--runtime-dir",
            str(runtime),
            "start",
            "--timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO),
    )


def _one_error_line(r) -> str:  # type: ignore[no-untyped-def]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stdout + r.stderr
    return lines[0]


@pytest.mark.parametrize("name", ["supervisor.log", "engine.log"])
def test_a_symlinked_log_is_refused_and_its_target_untouched(tmp_path, name):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (runtime / name).symlink_to(victim)
    line = _one_error_line(_start(tmp_path, runtime))
    assert name in line and "symlink" in line
    assert victim.read_text() == "precious\n"
    assert not (runtime / "supervisor.pid").exists()


def test_a_dir_others_can_write_to_is_refused(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir()
    os.chmod(runtime, 0o777)
    line = _one_error_line(_start(tmp_path, runtime))
    assert "0777" in line and "chmod 700" in line
    assert os.listdir(runtime) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_dir_of_another_user_is_refused(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, 65534, 65534)
    line = _one_error_line(_start(tmp_path, runtime))
    assert "belongs to uid 65534" in line
    assert os.listdir(runtime) == []


def test_a_new_dir_is_created_private(tmp_path):
    from opsctl.runtime import prepare_runtime_dir

    path = prepare_runtime_dir(tmp_path / "a" / "run")
    assert oct(path.stat().st_mode & 0o777) == "0o700"
