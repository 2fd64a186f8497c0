"""The CPU extension's build cache under faults: an engine killed inside the build, or while it held the build
lock, must not stop the next engine from starting (torch's own lock file outlives its holder), and a finished
build is loaded without taking any lock.  Each case runs `python -m kernels.cpu_ext` (what setup.sh runs; an
engine start calls the same function) in a fresh process against a private copy of this host's build."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernels import cpu_ext
from tests.cpu_kernel_cache import seed_cpu_kernels

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A private cache root holding a copy of the build this host already has (setup.sh made it)."""
    root = tmp_path / "cache"
    assert seed_cpu_kernels({"PAGEKEEPER_CACHE_DIR": str(root)})
    return root


def _folder(root: Path) -> Path:
    return root / "cpu-ext" / cpu_ext.build_key()


def _load(root: Path, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEKEEPER_CACHE_DIR": str(root), cpu_ext.ENV: "require"}
    started = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "kernels.cpu_ext"], capture_output=True, text=True, timeout=timeout, env=env
    )
    r.stdout += r.stderr  # structlog's default logger (no configure_logging here) prints to stdout
    return r, time.monotonic() - started


def test_a_lock_left_by_a_builder_killed_inside_the_build_is_removed_and_the_build_loads(cache: Path) -> None:
    folder = _folder(cache)
    (folder / cpu_ext.BUILT_MARKER).unlink(missing_ok=True)  # the killed builder never finished
    (folder / cpu_ext.TORCH_LOCK).write_text("")  # what torch's FileBaton leaves when its holder dies
    # and a second builder that was killed -9 while it held the build lock
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(600)",
            str(folder / "build.flock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(10)
    r, took = _load(cache)
    print(f"stale lock + a killed lock holder: exit {r.returncode} after {took:.1f} s")
    assert r.returncode == 0, r.stdout[-2000:]
    assert "cpu_kernels_stale_lock_removed" in r.stdout
    assert not (folder / cpu_ext.TORCH_LOCK).exists()
    assert (folder / cpu_ext.BUILT_MARKER).read_text().strip()  # the next start takes the direct path


def test_a_finished_build_loads_directly_whatever_lock_files_lie_about(cache: Path) -> None:
    folder = _folder(cache)
    assert (folder / cpu_ext.BUILT_MARKER).exists()
    (folder / cpu_ext.TORCH_LOCK).write_text("")  # would make torch's load() wait forever
    r, took = _load(cache, timeout=120)
    print(f"finished build with a stale torch lock: exit {r.returncode} after {took:.1f} s")
    assert r.returncode == 0, r.stdout[-2000:]
    assert (folder / cpu_ext.TORCH_LOCK).exists()  # not touched: the direct path takes no lock at all
    assert "cpu_kernels_stale_lock_removed" not in r.stdout


def test_a_damaged_library_under_a_finished_marker_is_built_again(cache: Path) -> None:
    folder = _folder(cache)
    library = folder / f"pagekeeper_cpu_{cpu_ext.build_key()}.so"
    library.write_bytes(b"not an ELF file")
    r, took = _load(cache)
    print(f"damaged library: exit {r.returncode} after {took:.1f} s")
    assert r.returncode == 0, r.stdout[-2000:]
    assert "cpu_kernels_reload_failed" in r.stdout
    assert library.read_bytes()[:4] == b"\x7fELF"
