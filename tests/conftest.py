"""Shared fixtures: random-weight checkpoints per architecture, built once per test session."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint

pytest_plugins = ["tests.memory_report"]  # the run's peak memory, and the tests that set it, in its summary


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


# -- the ten-minute soak (tests/opsctl/test_soak.py), run alongside the rest of the suite ------------------------

SOAK_SECONDS = 600.0
SOAK_PAUSE_S = 1.0  # each of the 8 clients pauses 1 s between requests: steady, and light on a 2-core machine


def _is_soak(item: pytest.Item) -> bool:
    return item.get_closest_marker("soak") is not None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The soak's check runs last, so that its ten minutes pass while the other tests run."""
    _skip_gpu_tests_without_cuda(items)
    items.sort(key=_is_soak)


@pytest.fixture(scope="session", autouse=True)
def _background_soak(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Starts tests/opsctl/soak.py in its own process at the session's first test, if the soak test runs."""
    if not any(_is_soak(item) for item in request.session.items):
        yield None
        return
    import subprocess
    import sys

    from tests.server.harness import REPO

    root = tmp_path_factory.mktemp("soak")
    out = root / "soak.json"
    log = open(root / "soak.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.opsctl.soak",
            "--seconds",
            str(SOAK_SECONDS),
            "--pause",
            str(SOAK_PAUSE_S),
            "--root",
            str(root / "d"),
            "--out",
            str(out),
        ],
        cwd=str(REPO),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    handle = {"proc": proc, "out": out, "root": root}
    yield handle
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    log.close()
    _teardown_soak_deployment(root / "d")


def _teardown_soak_deployment(root: Path) -> None:
    import json

    from tests.opsctl.harness import Deployment

    try:
        info = json.loads((root / "deployment.json").read_text())
    except (OSError, ValueError):
        return
    Deployment(root, Path(info["config"]), Path(info["runtime"]), int(info["port"])).teardown()


@pytest.fixture
def background_soak(_background_soak):  # type: ignore[no-untyped-def]
    return _background_soak
