"""Shared fixtures: random-weight checkpoints per architecture, built once per test session."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.openmp_waits import prefer_passive_waits

# The engines that tests run in this process wait as the server's do (engine/openmp_waits.py); libgomp reads the
# policy when torch loads it, so before the first import of torch.
prefer_passive_waits()

import torch  # noqa: E402

# Triton's interpreter without a GPU (tests/kernels/conftest.py says why), set here, before any test module imports
# triton: triton's own jit helpers (tl.sum, tl.max, ...) are made when triton is first imported, and a module
# outside tests/kernels/ that imported it first (collected before that folder's conftest) left them compiled-mode
# helpers, which interpreted kernels cannot call (115 kernel tests failed in a full run, none when run alone).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.server.harness import REPO  # noqa: E402

pytest_plugins = ["tests.memory_report"]  # the run's peak memory, and the tests that set it, in its summary


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


# -- the ten-minute soak (tests/opsctl/test_soak.py), run alongside the rest of the suite ------------------------

SOAK_SECONDS = 600.0
# Each of the 8 clients pauses between requests.  Measured alone (`python -m tests.opsctl.soak --seconds 90 --pause
# P`, the engine's CPU seconds from /proc, 2026-11-27): at 1 s the soak's engine served 6.4 requests/s on 0.85 of a
# core, at 2.5 s 2.9/s on 0.3.  In the suite at 2.5 s: 1,713 requests in 607 s, each client's turn 2.83 s (so 0.33 s
# a request), and the soak's processes used 231 CPU seconds, a fifth of what two cores give in ten minutes.  At 3 s
# a turn is about 3.35 s: about 1,450 requests (the test wants more than 1,000; that holds while a request takes
# under 1.6 s on average, five times what it took beside the suite).
SOAK_PAUSE_S = 3.0


def _is_soak(item: pytest.Item) -> bool:
    return item.get_closest_marker("soak") is not None


# Directories whose slow tests wait longest on real restarts, drains and timeouts (the chaos run, every exit code,
# the supervisor's faults, systemd boxes: 1.5-4 minutes each under `-n 2`).
LONGEST_FIRST = ("opsctl", "systemd")


def _order(item: pytest.Item, slow_modules: set[object]) -> tuple[bool, bool, int]:
    where = Path(str(item.fspath)).parent.name
    rank = LONGEST_FIRST.index(where) if where in LONGEST_FIRST else len(LONGEST_FIRST)
    return _is_soak(item), item.module not in slow_modules, rank


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The soak's check runs last, so that its ten minutes pass while the other tests run.  Before it, the modules
    that hold slow tests come first, the longest-waiting directories first of all; each module's tests stay
    together, so its module-scoped servers start once.  That order holds for a serial run.  Under README's
    `-n 2 --dist loadfile`, pytest-xdist hands out whole files sorted by their number of tests instead.  Keeping
    this order there (`--no-loadscope-reorder`) gained nothing on the 2-core build machine: 21:53-21:56 against
    20:33-24:05 with xdist's order, and the chaos and exit-code tests, started together, slowed each other
    (2026-11-26, cpu-suite-xdist-2026-11-26.txt)."""
    _skip_gpu_tests_without_cuda(items)
    slow_modules = {item.module for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: _order(item, slow_modules))


def _soak_dir(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session's one soak lives.  Under pytest-xdist every worker has a base temp dir of its own
    (<run>/popen-gwN) and the controller has <run>: the soak is in <run>/soak for all of them."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if hasattr(config, "workerinput") else base) / "soak"


@dataclass
class SoakHandle:
    """The background soak, whichever process started it: its files, and `wait()` for its exit status."""

    root: Path
    proc: subprocess.Popen | None = None  # only in the process that started it

    @property
    def out(self) -> Path:
        return self.root / "soak.json"

    @property
    def log(self) -> Path:
        return self.root / "soak.log"

    @property
    def status_file(self) -> Path:
        return self.root / "exit-status"  # written by the wrapping shell when tests.opsctl.soak exits

    def returncode(self) -> int | None:
        try:
            return int(self.status_file.read_text())
        except (OSError, ValueError):
            return None

    def wait(self, deadline: float) -> int | None:
        """The soak's exit status, waiting for it until `deadline` (time.monotonic()); None if still running."""
        while (rc := self.returncode()) is None and time.monotonic() < deadline:
            time.sleep(1)
        return rc

    def running(self) -> bool:
        try:
            pgid = int((self.root / "pgid").read_text())
        except (OSError, ValueError):
            return False
        if self.returncode() is not None:
            return False
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def start(self) -> None:
        """Start tests/opsctl/soak.py under a shell that records its exit status, in a session of its own: it
        outlives the pytest worker that started it, so that the soak test may run on any worker."""
        log = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [
                "sh",
                "-c",
                '"$@"; echo $? > "$0.tmp" && mv "$0.tmp" "$0"',
                str(self.status_file),
                sys.executable,
                "-m",
                "tests.opsctl.soak",
                "--seconds",
                str(SOAK_SECONDS),
                "--pause",
                str(SOAK_PAUSE_S),
                "--root",
                str(self.root / "d"),
                "--out",
                str(self.out),
            ],
            cwd=str(REPO),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        (self.root / "pgid").write_text(str(self.proc.pid))

    def stop(self) -> None:
        """Kill the soak if it still runs (an aborted session), and whatever it deployed; by PID."""
        if self.running():
            try:
                os.killpg(int((self.root / "pgid").read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        _teardown_soak_deployment(self.root / "d")


@pytest.fixture(scope="session", autouse=True)
def _background_soak(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Starts tests/opsctl/soak.py in its own process at the session's first test, if the soak test runs.

    Exactly once per run: under pytest-xdist each worker sets this fixture up, and the first to create the
    shared soak directory starts the soak (unless xdist's controller already did: `pytest_sessionstart`); the
    others (and the soak test, on whichever worker it lands) only read its files.  The process that is not a
    worker (plain pytest, or xdist's controller once every worker
    has finished) kills what is left of it at the end."""
    if not any(_is_soak(item) for item in request.session.items):
        yield None
        return
    handle = SoakHandle(_soak_dir(request.config, tmp_path_factory))
    try:
        handle.root.mkdir()
    except FileExistsError:
        pass  # another worker started it
    else:
        handle.start()
    yield handle
    if not hasattr(request.config, "workerinput"):
        handle.stop()


SOAK_TEST_FILE = Path(__file__).parent / "opsctl" / "test_soak.py"


def _soak_may_run(config: pytest.Config) -> bool:
    """Before collection, whether this run's selection can hold the soak: a path given (or testpaths) that holds
    its file, and no -m or -k (which may keep it out: those runs start it at their first test instead)."""
    if config.option.collectonly or config.option.markexpr or config.option.keyword:
        return False
    here = Path(config.invocation_params.dir)
    for arg in config.args:
        given = (here / arg.split("::")[0]).resolve()
        if given == SOAK_TEST_FILE or given in SOAK_TEST_FILE.parents:
            return True
    return False


def _is_xdist_controller(config: pytest.Config) -> bool:
    return config.pluginmanager.hasplugin("dsession")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """xdist's controller starts the soak before it starts the workers: they take half a minute to start and
    collect, which the ten minutes would otherwise add to the run.  A worker's `_background_soak` then finds it
    started; if no worker collected the soak test after all, `pytest_xdist_node_collection_finished` stops it."""
    config = session.config
    if not _is_xdist_controller(config) or not _soak_may_run(config):
        return
    root = _soak_dir(config, config._tmp_path_factory)  # type: ignore[attr-defined]
    root.mkdir(parents=True, exist_ok=True)
    SoakHandle(root).start()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """xdist's controller: a soak it started for a run whose workers did not collect the soak test is stopped."""
    config = node.config  # type: ignore[attr-defined]
    root = _soak_dir(config, config._tmp_path_factory)
    if root.is_dir() and not any(i.split("::")[0].endswith("opsctl/test_soak.py") for i in ids):
        SoakHandle(root).stop()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """xdist's controller: the soak's cleanup, after every worker has finished (a worker may end before the
    soak test, which runs on another, has read the soak's result)."""
    config = session.config
    if not config.pluginmanager.hasplugin("dsession"):  # not xdist's controller
        return
    root = _soak_dir(config, config._tmp_path_factory)  # type: ignore[attr-defined]
    if root.is_dir():
        SoakHandle(root).stop()


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
