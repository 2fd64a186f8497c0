"""benchmarks/suite_cpu.py: a command's CPU summed by kind of process, daemonized descendants included."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
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


BURN_CPU_S = 0.3  # CPU seconds each burner spends, measured by itself: the same on a fast host and a slow one
BURNER = """\
import sys, time
while time.process_time() < float(sys.argv[1]):
    sum(range(10_000))
with open(sys.argv[2], "w") as f:
    f.write(repr(time.process_time()))  # what it used, interpreter start-up included, as the sampler counts it
time.sleep(1.0)  # at rest, sampled every interval: the sampler cannot see CPU spent after its last sample
if len(sys.argv) > 3:
    open(sys.argv[3], "w").close()
"""


def test_a_daemonized_grandchild_is_counted(tmp_path: Path) -> None:
    """One burner as a plain child, one double-forked away from the command (as the supervisor daemonizes): the
    command's own rusage never sees the second, the sampler does.  Each burner spends a fixed CPU time and reports
    what it used; the sampler's count must match that report (it once asserted a wall-clock guess of the burn's
    cost, which a 2-core build machine, at 0.40-0.49 CPU-s a burn, failed).

    The grandchild waits before it execs, so the sampler meets it with its parent's command line first (under load
    it did by chance, and counted it as its parent: 1 burner of 2).  The sampler reads every process on the host, so
    the burner's name is this run's own (a test run beside this one counted 3)."""
    burn = tmp_path / f"burn_{uuid.uuid4().hex[:8]}.py"
    burn.write_text(BURNER)
    done, used = tmp_path / "done", [tmp_path / "used-child", tmp_path / "used-grandchild"]
    script = (
        "import os, subprocess, sys, time\n"
        f"subprocess.run([sys.executable, {str(burn)!r}, {str(BURN_CPU_S)!r}, {str(used[0])!r}])\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(0.3)\n"
        f"        os.execv(sys.executable, [sys.executable, {str(burn)!r}, {str(BURN_CPU_S)!r}, {str(used[1])!r}, "
        f"{str(done)!r}])\n"
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
    burners = result["by_kind"][f"python {burn.name}"]
    reported = sum(float(path.read_text()) for path in used)
    print(
        f"burners: {burners} against {reported:.2f} CPU-s they reported using; "
        f"sampled {result['sampled_cpu_s']} of {result['host_busy_cpu_s']} host CPU s"
    )
    assert burners["processes"] == 2
    assert reported >= 2 * BURN_CPU_S
    # by_kind rounds to 0.1 s; the burners' CPU after their report (the write, the sleep, the exit) is a few ms
    assert abs(burners["cpu_s"] - reported) <= 0.1, (burners, reported)
    assert result["exit_status"] == 0 and 0 < result["sampled_cpu_s"] <= result["host_busy_cpu_s"] * 1.05
    # both burners inherited this test's PYTEST_CURRENT_TEST (through a double fork): counted under this file
    this_file = result["by_test_file"]["tests/benchmarks/test_suite_cpu.py"]
    assert this_file["processes"] >= 3 and this_file["cpu_s"] >= burners["cpu_s"], result["by_test_file"]
    this_test = result["by_test_top"]["tests/benchmarks/test_suite_cpu.py::test_a_daemonized_grandchild_is_counted"]
    assert this_test == this_file, result["by_test_top"]


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


def test_a_pytest_run_reports_each_tests_own_cpu(tmp_path: Path) -> None:
    """The pytest process's own CPU by test (tests/cpu_report.py, switched on by the benchmark's variable): a test
    that burns a fixed CPU time in-process is credited with at least that, one that sleeps with almost none."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_burn.py").write_text(
        "import time\n"
        "def test_burns():\n"
        f"    end = time.process_time() + {BURN_CPU_S}\n"
        "    while time.process_time() < end:\n"
        "        sum(range(10_000))\n"
        "def test_sleeps():\n"
        "    time.sleep(0.3)\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite_cpu", "--out", str(tmp_path), "--interval", "0.2", "--",
         sys.executable, "-m", "pytest", "-q", "-p", "tests.cpu_report", "-c", str(tmp_path / "pytest.ini"),
         str(tmp_path / "test_burn.py")],
        capture_output=True, text=True, timeout=300, cwd=str(REPO),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    top = result["in_process_top"]
    burns = next(v["cpu_s"] for k, v in top.items() if k.endswith("::test_burns"))
    sleeps = next(v["cpu_s"] for k, v in top.items() if k.endswith("::test_sleeps"))
    print(f"in-process: test_burns {burns} CPU-s, test_sleeps {sleeps} CPU-s")
    assert burns >= BURN_CPU_S - 0.05 and sleeps < 0.1, top
    (file_row,) = result["in_process_by_test_file"].values()
    assert abs(file_row["cpu_s"] - (burns + sleeps)) <= 0.1  # the file's sum of its tests, each rounded to 0.1
    assert result["in_process_cpu_s"] >= burns
