"""benchmarks/openmp_waits.py: a real server per policy, its CPU per token beside busy processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import openmp_waits


def test_bad_arguments_are_usage_errors(tmp_path, capsys):
    for argv in (
        ["--policies", "sleepy"],
        ["--policies", "active-x"],
        ["--busy", "x"],
        ["--busy", "-1"],
        ["--requests", "0"],
        ["--prompt-tokens", "-1"],
    ):
        with pytest.raises(SystemExit) as e:
            openmp_waits.main([*argv, "--out", str(tmp_path)])
        assert e.value.code == 2
        print(capsys.readouterr().err.strip().splitlines()[-1])
    assert not any(tmp_path.iterdir())


def test_policies_name_their_environment() -> None:
    assert openmp_waits._policy_env("default") == {}  # the engine's own choice (engine/openmp_waits.py)
    assert openmp_waits._policy_env("passive") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_waits._policy_env("spin-500") == {"GOMP_SPINCOUNT": "500"}
    assert openmp_waits._policy_env("active-500") == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "500"}


def test_prompts_of_token_ids_differ_per_request() -> None:
    assert openmp_waits._prompt(3, 0) == "request 3: hello there"
    a, b = openmp_waits._prompt(0, 128), openmp_waits._prompt(1, 128)
    assert len(a) == len(b) == 128 and a[:16] != b[:16] and all(3 <= t < 380 for t in a + b)


def test_the_server_cpu_counts_its_engine_core_process() -> None:
    """The server's engine core runs in a child process (engine/loop/): its CPU is the server's too."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(120)"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"
    parent = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while openmp_waits._tree_cpu_seconds(parent.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        tree, own = openmp_waits._tree_cpu_seconds(parent.pid), openmp_waits._cpu_seconds(parent.pid)
        print(f"the parent's own CPU {own:.2f} s, with its child's {tree:.2f} s")
        assert tree >= 0.5 > own
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(30)


@pytest.mark.slow
def test_one_policy_beside_one_busy_process(tmp_path):
    assert openmp_waits.main(["--policies", "passive", "--busy", "1", "--requests", "2", "--max-tokens", "4",
                              "--prompt-tokens", "16", "--out", str(tmp_path)]) == 0  # fmt: skip
    (result,) = tmp_path.glob("openmp-waits-cpu-*.json")
    data = json.loads(result.read_text())
    print(data["runs"])
    (run,) = data["runs"]
    assert run["policy"] == "passive" and run["busy_processes"] == 1
    assert run["tokens"] == 8 and run["server_cpu_s"] > 0 and run["wall_s"] > 0
    assert run["cpu_ms_per_token"] == pytest.approx(run["server_cpu_s"] / 8 * 1e3, rel=0.01)
    assert data["prompt_tokens"] == 16 and run["ms_per_request"] == pytest.approx(run["wall_s"] / 2 * 1e3, rel=0.01)
    assert [p.name for p in tmp_path.iterdir()] == [result.name]  # the server's log is not left behind
