"""benchmarks/suite_cpu.py: a command's CPU summed by kind of process, daemonized descendants included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.suite_cpu import kind_of

REPO = Path(__file__).resolve().parents[2]


def test_kinds_follow_the_command_line() -> None:
    assert kind_of("/usr/bin/python3 -m engine.server --port 1 --listen-fd 4") == "engine server"
    assert kind_of("python3 -m opsctl.supervisor --runtime-dir /r") == "supervisor"
    assert kind_of("python3 -m opsctl.cli --config c status") == "opsctl call"
    assert kind_of("python3 -u -c import sys;exec(eval(sys.stdin.readline()))") == "pytest worker"
    assert kind_of("/usr/lib/gcc/x86_64-linux-gnu/12/cc1plus -quiet x.cpp") == "compiler"
    assert kind_of("/usr/bin/python3 /tmp/pytest-of-root/pytest-1/burn.py") == "python burn.py"  # a path, not pytest
    assert kind_of("/usr/bin/python3 -m pytest -n 2") == "pytest"
    assert kind_of("python3 -m benchmarks.serving --quick") == "python benchmarks.serving"
    assert kind_of("python3 tests/x.py") == "python x.py"
    assert kind_of("") == "kernel thread or unreadable"


def test_a_daemonized_grandchild_is_counted(tmp_path: Path) -> None:
    # one burner as a plain child, one double-forked away from the command (as the supervisor daemonizes): the
    # command's own rusage never sees the second, the sampler does
    burn = tmp_path / "burn.py"
    burn.write_text("import sys\nsum(range(20_000_000))\nif len(sys.argv) > 1:\n    open(sys.argv[1], 'w').close()\n")
    done = tmp_path / "done"
    script = (
        "import os, subprocess, sys, time\n"
        f"subprocess.run([sys.executable, {str(burn)!r}])\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, {str(burn)!r}, {str(done)!r}])\n"
        "    os._exit(0)\n"
        f"while not os.path.exists({str(done)!r}):\n"
        "    time.sleep(0.05)\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite_cpu", "--out", str(tmp_path), "--interval", "0.05", "--",
         sys.executable, "-c", script],
        capture_output=True, text=True, timeout=300, cwd=str(REPO),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result == json.loads(next(tmp_path.glob("suite-cpu-*.json")).read_text())
    burners = result["by_kind"]["python burn.py"]
    print(f"burners: {burners}, sampled {result['sampled_cpu_s']} of {result['host_busy_cpu_s']} host CPU s")
    assert burners["processes"] == 2
    assert burners["cpu_s"] >= 0.8  # two burns of about 0.5-1 s each, less the scan's blind last interval
    assert result["exit_status"] == 0 and 0 < result["sampled_cpu_s"] <= result["host_busy_cpu_s"] * 1.05


def test_a_failing_command_fails_and_no_command_is_a_usage_error(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite_cpu", "--out", str(tmp_path), "--", sys.executable, "-c", "exit(3)"],
        capture_output=True, text=True, timeout=60, cwd=str(REPO),
    )  # fmt: skip
    assert r.returncode == 1 and json.loads(r.stdout.strip().splitlines()[-1])["exit_status"] == 3
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite_cpu", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=str(REPO),
    )  # fmt: skip
    assert r.returncode == 2 and "usage" in r.stderr
