"""One supervisor observation against a real engine process that exits 2 while it is being watched.

CI once saw an engine that exited 2 (a bad model path) restarted once before the supervisor gave up: the
process probe saw it gone before the launcher had reaped it, so the observation said "process dead" without
"exit permanent", and the policy chose engine_exited (restart).  An observation that says the process is
dead must also carry how it exited; this polls as fast as it can across the exit to catch the moment.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from opsctl.config import load_config
from opsctl.daemon import Supervisor
from opsctl.policy import PolicyState, decide
from opsctl.probes import EngineProbe, FakeGpuProbe
from opsctl.runtime import prepare_runtime_dir
from opsctl.supervisor import build_launcher
from tests.opsctl.harness import FAST_SUPERVISOR, write_config
from tests.server.harness import free_port


def test_an_observation_of_a_dead_engine_says_how_it_exited(tmp_path: Path) -> None:
    observe_until_exit(tmp_path)


# The engine's main thread ends at once (pthread_exit) and another thread exits 2 a second later: for that second
# the process is a zombie to /proc (what the process probe reads) while waitpid does not report it yet, the
# window CI hit once at random.
_ZOMBIE_LEADER = """
import ctypes, os, threading, time

def _exit_later():
    time.sleep(1.0)
    os._exit(2)

threading.Thread(target=_exit_later).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_zombie_main_thread_is_observed_with_its_exit_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(textwrap.dedent(_ZOMBIE_LEADER))
    monkeypatch.setenv("PYTHONPATH", str(inject))  # the engine process imports it at start-up
    observe_until_exit(tmp_path)  # without the launcher's settle wait this fails every time (checked)


def observe_until_exit(tmp_path: Path) -> None:
    """Observe an engine that exits 2 until an observation says it is dead; that one must say how."""
    runtime = tmp_path / "run"
    config = write_config(
        tmp_path / "pagekeeper.toml",
        {"model": str(tmp_path / "no-such-model"), "port": free_port()},
        {**FAST_SUPERVISOR, "runtime_dir": str(runtime)},
    )
    cfg = load_config(str(config), {})
    prepare_runtime_dir(runtime)
    gpu_file = tmp_path / "gpu.json"
    gpu_file.write_text("[]")
    gpu = FakeGpuProbe(str(gpu_file))
    launcher = build_launcher(cfg, runtime, gpu)
    sup = Supervisor(cfg, launcher, EngineProbe(cfg.engine_url, 0.2), gpu)
    launcher.start()
    try:
        observations = 0
        deadline = time.monotonic() + 60
        while True:
            obs = sup.observe()
            observations += 1
            if not obs.process_alive:
                break
            assert time.monotonic() < deadline, "the engine with a missing model did not exit within 60 s"
        print(f"{observations} observations until the engine exited: exit_permanent={obs.exit_permanent}")
        print(f"launcher: {launcher.exit_summary()}")
        assert obs.exit_permanent, launcher.exit_summary()
        action = decide([obs], PolicyState(started_at=obs.t), sup.policy_cfg, time.monotonic())
        assert (action.kind, action.reason, action.permanent) == ("give_up", "permanent_failure", True)
    finally:
        launcher.stop(drain=False, timeout=5)
        launcher.close()
