"""Shared fixtures: random-weight checkpoints per architecture, built once per test session."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from pathlib import Path

import pytest

from engine.openmp_waits import chosen_waits

# The test run is a shared host (parallel tests, busy processes beside servers, a loaded CI machine), the case
# where OpenMP's idle threads should sleep rather than spin (engine/openmp_waits.py): the engines that tests run, in
# this process and in the servers it starts (which keep a wait knob they inherit), use PASSIVE unless the runner
# chose a knob.  libgomp reads it when torch loads, so before the first import of torch.  A test of the engine's own
# default clears the knobs for its server (tests/server/test_cpu_threads.py).
if not chosen_waits():
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import torch  # noqa: E402

# Triton's interpreter without a GPU (tests/kernels/conftest.py says why), set here, before any test module imports
# triton: triton's own jit helpers (tl.sum, tl.max, ...) are made when triton is first imported, and a module
# outside tests/kernels/ that imported it first (collected before that folder's conftest) left them compiled-mode
# helpers, which interpreted kernels cannot call (115 kernel tests failed in a full run, none when run alone).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.checkpoints import make_checkpoint  # noqa: E402

pytest_plugins = ["tests.memory_report", "tests.cpu_report"]  # peak memory in the summary; CPU by test on request


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker's base temp dir is <run>/popen-gwN; <run>/gwN instead.  The tests put Unix sockets in their
    tmp_path (supervisor.sock, eng-<pid>-<n>.sock under runtime dirs such as run/pagekeeper@alpha/), and the 108
    bytes of a socket's path leave no room for those 6 characters: `AF_UNIX path too long`.  Runs before the
    tmp_path factory reads the option (the tmpdir plugin's pytest_configure)."""
    workerinput = getattr(config, "workerinput", None)
    basetemp = getattr(config.option, "basetemp", None)
    if workerinput is not None and basetemp:
        given = Path(basetemp)
        if given.name == f"popen-{workerinput['workerid']}":
            config.option.basetemp = str(given.with_name(workerinput["workerid"]))


def _skip_gpu_tests_without_cuda(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# -- memory: each module's engines go back to the OS before the next module -----------------------------------

RELEASE_AFTER_GROWTH_BYTES = 64 << 20
_released_at_rss = 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module", autouse=True)
def _release_module_memory():
    """Engines built in this process sit in reference cycles (modules, hooks, a traceback's frames) that only a
    full collection frees, and glibc keeps what is freed in its heap: over a whole run the pytest process crept
    to 2.02 GB though no module needs more than about 1 GB alone.  A full collection takes about 0.3 s, so it runs
    only after a module whose memory grew."""
    global _released_at_rss
    yield
    if not sys.platform.startswith("linux") or _rss_bytes() - _released_at_rss < RELEASE_AFTER_GROWTH_BYTES:
        return
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    _released_at_rss = _rss_bytes()


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def checkpoint(checkpoint_root: Path):
    """checkpoint(arch) -> directory of a float32 random-weight checkpoint saved by transformers."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_checkpoint(arch, checkpoint_root / arch)
        return made[arch]

    return get


# Directories whose slow tests wait longest on real restarts, drains and timeouts (the chaos run, every exit code,
# the supervisor's faults, systemd boxes: 1.5-4 minutes each under `-n 2`).
LONGEST_FIRST = ("opsctl", "systemd")


def _order(item: pytest.Item, slow_modules: set[object]) -> tuple[bool, int]:
    where = Path(str(item.fspath)).parent.name
    rank = LONGEST_FIRST.index(where) if where in LONGEST_FIRST else len(LONGEST_FIRST)
    return item.module not in slow_modules, rank


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that hold slow tests come first, the longest-waiting directories first of all; each module's
    tests stay together, so its module-scoped servers start once.  That order holds for a serial run.  Under README's
    `-n 3 --dist loadfile`, pytest-xdist hands out whole files sorted by their number of tests instead.  Keeping
    this order there (`--no-loadscope-reorder`) gained nothing on the 2-core build machine: 21:53-21:56 against
    20:33-24:05 with xdist's order, and the chaos and exit-code tests, started together, slowed each other
    (2026-11-26, cpu-suite-xdist-2026-11-26.txt)."""
    _skip_gpu_tests_without_cuda(items)
    slow_modules = {item.module for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: _order(item, slow_modules))
