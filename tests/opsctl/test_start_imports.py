"""What `opsctl` and the supervisor import before the engine is spawned (issue 35: a start in seconds): neither rich
(structlog's console renderer offered it; engine/lean_imports.py), nor httpx (the engine probe's client, made at the
first probe), nor torch or anything of the engine's model; the CLI not prometheus_client either (the probe's metrics
parser).  Their logs stay what they were: readable lines in a terminal, JSON lines otherwise."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

from tests.server.harness import REPO, free_port

NEVER = ("rich", "colorama", "httpx", "torch", "numpy", "transformers", "tokenizers", "safetensors", "jinja2")
NOT_IN_CLI = (*NEVER, "prometheus_client")


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("NO_COLOR", None)  # a terminal's lines are colored, unless a person asked otherwise
    return env


# Runs `python -m MODULE ARGS` and writes the modules it holds at its exit to $MODULES_OUT (stdout is the command's)
_DRIVER = """
import atexit, json, os, runpy, sys
atexit.register(lambda: open(os.environ["MODULES_OUT"], "w").write(json.dumps(sorted(sys.modules))))
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    "args,absent,code",
    [
        (["opsctl", "--help"], NOT_IN_CLI, 0),
        (["opsctl", "--runtime-dir", "{tmp}/run", "status"], NOT_IN_CLI, 3),  # reads the config, asks the socket
        (["opsctl.supervisor", "--help"], NEVER, 0),
    ],
    ids=["opsctl --help", "opsctl status", "supervisor --help"],
)
def test_the_entry_points_leave_the_heavy_modules_out(tmp_path, args, absent, code):
    out = tmp_path / "modules.json"
    argv = [a.format(tmp=tmp_path) for a in args]
    r = subprocess.run(
        [sys.executable, "-c", _DRIVER, *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**_env(), "MODULES_OUT": str(out)},
    )
    assert r.returncode == code, r.stdout + r.stderr
    loaded = json.loads(out.read_text())
    assert "structlog" in loaded and ("click" in loaded or "argparse" in loaded)  # it did run
    assert _of(loaded, absent) == []


def _of(modules: list[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in packages))


def test_a_supervisor_spawns_its_engine_without_them(tmp_path):
    """The whole way to the spawn: config, lock, probes, metrics, the socket, the engine's process.  The engine
    refuses its model at once (exit 2, before its own imports), so this supervisor never probes it over HTTP."""
    port = free_port()
    config = tmp_path / "pagekeeper.toml"
    config.write_text(
        f'[engine]\nmodel = "{tmp_path}/no-such-model"\nport = {port}\n\n'
        '[supervisor]\nmetrics_port = 0\nlauncher = "process"\n'
    )
    out, runtime = tmp_path / "modules.json", tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-c", _DRIVER, "opsctl.supervisor", "--config", str(config), "--runtime-dir", str(runtime)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**_env(), "MODULES_OUT": str(out)},
        timeout=120,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--- engine start" in (runtime / "engine.log").read_text()  # it was spawned, and exited
    assert "no-such-model" in json.loads((runtime / "last_failure.json").read_text())["reason"]
    assert _of(json.loads(out.read_text()), NEVER) == []


# A supervisor-like process: the supervisor's modules, our logging, one event, one exception, one library record
_LOGS = """
import logging, sys
import opsctl.supervisor
import structlog
from engine.logs import configure_logging
configure_logging()
log = structlog.get_logger("pagekeeper.supervisor")
log.info("engine_started", pid=42, launcher="process")
try:
    1 / 0
except ZeroDivisionError:
    log.exception("poll_failed")
    logging.getLogger("some.library").error("library trouble", exc_info=True)
print("RICH" if "rich" in sys.modules else "NO RICH", file=sys.stderr, flush=True)
"""


def _run_logs(stderr_tty: bool) -> str:
    env = _env()
    if not stderr_tty:
        r = subprocess.run([sys.executable, "-c", _LOGS], capture_output=True, text=True, cwd=REPO, env=env)
        assert r.returncode == 0, r.stderr
        return r.stderr
    leader, follower = pty.openpty()
    try:
        p = subprocess.Popen(
            [sys.executable, "-c", _LOGS], stderr=follower, stdout=subprocess.DEVNULL, cwd=REPO, env=env
        )
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert p.wait(timeout=60) == 0
    finally:
        os.close(leader)
    return b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def test_a_terminal_gets_readable_lines_with_tracebacks_without_rich():
    out = _run_logs(stderr_tty=True)
    lines = out.splitlines()
    assert out.rstrip().endswith("NO RICH"), out
    started = next(ln for ln in lines if "engine_started" in ln)
    assert "pid" in started and "42" in started and "launcher" in started and not started.lstrip().startswith("{")
    assert "\x1b[" in started  # colored, as before
    assert "Traceback (most recent call last)" in out and "ZeroDivisionError: division by zero" in out
    assert "library trouble" in out and out.count("ZeroDivisionError") >= 2  # the library's record, its traceback too
    assert not any(ln.lstrip().startswith("{") for ln in lines), out


def test_a_file_or_pipe_gets_json_lines():
    out = _run_logs(stderr_tty=False)
    lines = out.splitlines()
    assert lines[-1] == "NO RICH", out
    events = [json.loads(ln) for ln in lines[:-1]]
    assert [e["event"] for e in events] == ["engine_started", "poll_failed", "library trouble"]
    assert events[0]["pid"] == 42 and events[0]["level"] == "info"
    assert "ZeroDivisionError: division by zero" in events[1]["exception"]
    assert events[2]["logger"] == "some.library" and events[2]["level"] == "error"
