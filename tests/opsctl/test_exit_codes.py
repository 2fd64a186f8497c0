"""Exit codes automation can trust: `opsctl status` and `opsctl start` in every state, on real processes.

`opsctl status` is 0 only while the engine serves (like `systemctl is-active`); every other state has
its own code (see opsctl/cli.py).  The states come from real faults: a drain, a stopped engine, a
killed supervisor, a crash loop, a model that cannot load.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.server.harness import REPO

pytestmark = pytest.mark.slow

EXPECTED = {  # state: (status, start)
    "not running": (3, None),
    "starting": (4, None),
    "serving": (0, 0),
    "draining": (5, 5),
    "unhealthy (engine stopped)": (8, None),
    "engine without a supervisor": (7, 0),
    "gave up (crash loop)": (6, 6),
    "failed (engine exit 2)": (3, 2),
    "stopped": (3, 0),
}


def _code(d, *args: str) -> int:
    return d.opsctl(*args, timeout=240).returncode


def _poll_code(d, want: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    code = -1
    while time.monotonic() < deadline:
        code = _code(d, "status")
        if code == want:
            return code
        time.sleep(0.2)
    return code


_GATE = """\
import os, sys, time
if 'engine.server' in sys.orig_argv:
    deadline = time.monotonic() + 120
    while os.path.exists({gate!r}) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def _start_gate(where: Path) -> Path:
    """A closed gate: an engine front started with `where` on its PYTHONPATH waits while the returned file exists."""
    where.mkdir()
    gate = where / "closed"
    gate.touch()
    (where / "sitecustomize.py").write_text(_GATE.format(gate=str(gate)))
    return gate


def test_status_and_start_exit_codes_in_every_state(deploy, tmp_path):
    seen: dict[str, tuple[int | None, int | None]] = {}
    d = deploy(supervisor={"hang_seconds": 60})  # long enough to watch a stopped engine before it is restarted
    seen["not running"] = (_code(d, "status"), None)

    # The engine is held at its interpreter's start until the test has seen "starting": without the gate, the
    # embedded model served before a loaded machine's `opsctl status` landed (1 run in 5 missed the state).
    gate = _start_gate(tmp_path / "gate")
    cmd = [sys.executable, "-m", "opsctl.cli", "--config", str(d.config), "--runtime-dir", str(d.runtime), "start"]
    env = d.env({"PYTHONPATH": f"{gate.parent}:{REPO}"})
    starting = subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen["starting"] = (_poll_code(d, 4, 60), None)
    finally:
        gate.unlink()
    assert starting.wait(120) == 0
    seen["serving"] = (_code(d, "status"), _code(d, "start"))

    assert _code(d, "drain", "--timeout", "5") == 0
    seen["draining"] = (_poll_code(d, 5, 10), _code(d, "start"))
    assert _code(d, "drain", "--cancel") == 0 and _code(d, "status") == 0

    engine = d.status()["engine"]["pid"]
    os.kill(engine, signal.SIGSTOP)
    try:
        seen["unhealthy (engine stopped)"] = (_poll_code(d, 8, 20), None)
    finally:
        os.kill(engine, signal.SIGCONT)
    assert _poll_code(d, 0, 20) == 0

    os.kill(d.status()["supervisor"]["pid"], signal.SIGKILL)
    time.sleep(1)
    seen["engine without a supervisor"] = (_code(d, "status"), _code(d, "start"))
    assert d.status()["engine"]["pid"] == engine  # adopted, not replaced
    r = d.opsctl("stop")
    assert r.returncode == 0
    seen["stopped"] = (_code(d, "status"), None)

    # kill -9 of the supervisor, then `opsctl stop`: no orphan engine is left
    assert _code(d, "start") == 0
    st = d.status()
    os.kill(st["supervisor"]["pid"], signal.SIGKILL)
    time.sleep(1)
    r = d.opsctl("stop")
    assert r.returncode == 0 and "without a supervisor" in r.stdout, r.stdout + r.stderr
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{st['engine']['pid']}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{st['engine']['pid']}"), "the engine outlived `opsctl stop`"
    seen["stopped"] = (seen["stopped"][0], _code(d, "start"))
    assert _code(d, "stop") == 0

    crasher = tmp_path / "crash" / "sitecustomize.py"
    crasher.parent.mkdir()
    crasher.write_text("import sys\nif 'engine.server' in sys.orig_argv:\n    sys.exit(1)\n")
    loop = deploy(supervisor={"max_restarts": 1})
    start = loop.opsctl("start", env={"PYTHONPATH": f"{crasher.parent}:{REPO}"}).returncode
    seen["gave up (crash loop)"] = (_code(loop, "status"), _code(loop, "start") if start == 6 else start)

    bad = deploy(engine={"model": str(tmp_path / "no-model")})
    start = _code(bad, "start")
    seen["failed (engine exit 2)"] = (_code(bad, "status"), start)

    print("\nstate                          status  start (want)")
    for state, (status, start_code) in seen.items():
        print(f"{state:<30} {status!s:>6} {start_code!s:>6}   {EXPECTED[state]}")
    assert seen == EXPECTED
