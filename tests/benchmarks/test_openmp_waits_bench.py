"""benchmarks/openmp_waits.py: a real server per policy, its CPU per token beside busy processes."""

from __future__ import annotations

import json

import pytest

from benchmarks import openmp_waits


def test_bad_arguments_are_usage_errors(tmp_path, capsys):
    for argv in (["--policies", "sleepy"], ["--busy", "x"], ["--busy", "-1"], ["--requests", "0"]):
        with pytest.raises(SystemExit) as e:
            openmp_waits.main([*argv, "--out", str(tmp_path)])
        assert e.value.code == 2
        print(capsys.readouterr().err.strip().splitlines()[-1])
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_one_policy_beside_one_busy_process(tmp_path):
    assert openmp_waits.main(["--policies", "passive", "--busy", "1", "--requests", "2", "--max-tokens", "4",
                              "--out", str(tmp_path)]) == 0  # fmt: skip
    (result,) = tmp_path.glob("openmp-waits-cpu-*.json")
    data = json.loads(result.read_text())
    print(data["runs"])
    (run,) = data["runs"]
    assert run["policy"] == "passive" and run["busy_processes"] == 1
    assert run["tokens"] == 8 and run["server_cpu_s"] > 0 and run["wall_s"] > 0
    assert run["cpu_ms_per_token"] == pytest.approx(run["server_cpu_s"] / 8 * 1e3, rel=0.01)
    assert [p.name for p in tmp_path.iterdir()] == [result.name]  # the server's log is not left behind
