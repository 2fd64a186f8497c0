"""Issue 36's device run (benchmarks/tp_device_run.py) on the CPU: its stages' command lines for any number of GPUs,
the top-level keys it derives, the merge of the restart run's figure, and the whole run in its --quick form (gloo,
the embedded model), so that argument parsing and JSON writing cannot fail on the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import tensor_parallel
from benchmarks.tp_device_run import REPO, commands, headline, main, pytest_summary


def _arm(name: str, tok_s: float, fraction: float, tokens: int = 0) -> dict:
    return {
        "arm": name,
        "tok_s": tok_s,
        "overlap_tokens": tokens,
        "bound_fraction_overlapped": fraction,
        "bound_fraction_serial": fraction + 0.1,
    }


def test_the_top_level_keys_come_from_the_stages_results():
    runs = [
        {"tp": 1, "tok_s": 100.0, "arms": [_arm("plain", 100.0, 0.7)]},
        {"tp": 2, "tok_s": 180.0, "arms": [_arm("plain", 180.0, 0.65)]},
        {"tp": 4, "tok_s": 300.0, "arms": [_arm("plain", 300.0, 0.6)]},
    ]
    tensor_parallel.scaling(runs)
    seventy = {
        "runs": [
            {
                "tp": 4,
                "arms": [_arm("plain", 4000.0, 0.62), _arm("overlap", 4400.0, 0.68, 2048)],
                "batch1": {"ms_per_token": 21.5},
            }
        ]
    }
    correctness = {
        "correctness": {
            "float32": {
                "tp1": {"tp": 1},
                "tp2": {
                    "greedy_vs_first": {"identical": 32, "prompts": 32},
                    "logits_vs_first": {"max_abs_logit_diff": 2e-5},
                },
            },
            "bfloat16": {"tp1": {"batch_composition_noise": {"max_abs_logit_diff": 0.25}}},
        }
    }
    top = headline({"8b": {"runs": runs}, "70b": seventy, "correctness": correctness}, quick=False)
    assert top["scaling_efficiency_tp4"] == 0.75
    assert top["tp4_70b_tok_s"] == 4400.0 and top["tp4_70b_bound_fraction"] == 0.68
    assert top["tp4_70b_arm"] == "--tensor-parallel-overlap-tokens 2048"
    assert top["tp4_70b_tok_s_plain"] == 4000.0 and top["tp4_70b_bound_fraction_serial_overlap"] == pytest.approx(0.78)
    assert top["tp4_70b_batch1_ms_per_token"] == 21.5
    assert "tp4_restart_failed" in top and top["tp4_restart_failed"] is None  # the restart run merges it
    assert top["float32_greedy_identical_vs_tp1"] == {"tp2": "32/32"}
    assert top["bfloat16_tp1_batch_composition_max_abs_logit_diff"] == 0.25
    assert [r["scaling_efficiency"] for r in top["scaling_8b"]] == [None, 0.9, 0.75]
    nccl = {"runs": [{"tp": 4, "arms": [_arm("plain", 3500.0, 0.5)], "batch1": {"ms_per_token": 25.0}}]}
    before = headline({"70b": seventy, "70b-nccl": nccl}, quick=False)  # the same engine, all sums on NCCL
    assert before["tp4_70b_tok_s_plain_nccl_allreduce"] == 3500.0
    assert before["tp4_70b_bound_fraction_plain_nccl_allreduce"] == 0.5
    assert before["tp4_70b_batch1_ms_per_token_nccl_allreduce"] == 25.0 and before["tp4_70b_tok_s"] == 4400.0
    empty = headline({}, quick=False)  # nothing delivered: the keys are there, null
    assert empty["tp4_70b_tok_s"] is None and empty["scaling_efficiency_tp4"] is None


def test_each_stage_runs_what_this_many_gpus_allow(tmp_path):
    sizes = [16384, 134217728]
    four = {s: commands(s, False, 4, tmp_path, sizes, 2048) for s in ("allreduce", "70b", "8b", "correctness")}
    assert " --tp 2 4 --sizes 16384 134217728 --out " in " ".join(four["allreduce"])
    assert " --shape 70b --tp 4 --overlap-ab 2048 --batch1 " in " ".join(four["70b"]) + " "
    assert "--allreduce-json" in four["70b"] and "--allreduce-json" in four["8b"]
    assert " --tp 1 2 4 " in " ".join(four["8b"]) and " --tp 1 2 4 " in " ".join(four["correctness"])
    two = {s: commands(s, False, 2, tmp_path, sizes, 2048) for s in ("allreduce", "70b", "8b")}
    assert (
        two["70b"] is None and " --tp 1 2 " in " ".join(two["8b"]) and " --tp 2 --sizes " in " ".join(two["allreduce"])
    )
    assert commands("8b", False, 1, tmp_path, sizes, 2048) is None
    nccl = commands("70b-nccl", False, 4, tmp_path, sizes, 2048)  # the 70b command, its own result file
    assert nccl[nccl.index("--json") + 1] == str(tmp_path / "70b-nccl.json")
    assert [a for a in nccl if "70b" not in a] == [a for a in four["70b"] if "70b" not in a]
    assert commands("70b-nccl", False, 2, tmp_path, sizes, 2048) is None
    assert commands("tests", False, 0, tmp_path, sizes, 2048)[-1] == "tests/kernels/test_tensor_parallel_gpu.py"


def test_pytests_summary_line_is_read():
    assert pytest_summary("....\n4 passed, 2 skipped in 51.20s\n") == {"passed": 4, "skipped": 2}
    assert pytest_summary("x\n= 1 failed, 5 passed, 1 error in 3.1s =\n") == {"failed": 1, "passed": 5, "error": 1}
    assert pytest_summary("no summary") == {}


def test_the_restart_runs_figures_are_merged_into_a_finished_file(tmp_path, capsys):
    path = tmp_path / "tp-h100x4-2026-11-28.json"
    path.write_text(json.dumps({"tp4_70b_tok_s": 4400.0, "tp4_restart_failed": None}))
    assert (
        main(
            [
                "--merge",
                str(path),
                "--set",
                "tp4_restart_failed=0",
                "tp4_restart_longest_gap_s=1.9",
                "tp4_restart_note=8 clients",
            ]
        )
        == 0
    )
    data = json.loads(path.read_text())
    assert data == {
        "tp4_70b_tok_s": 4400.0,
        "tp4_restart_failed": 0,
        "tp4_restart_longest_gap_s": 1.9,
        "tp4_restart_note": "8 clients",
    }
    assert main(["--merge", str(path), "--set", "no-equals-sign"]) == 2
    with pytest.raises(SystemExit) as e:
        main(["--merge", str(path)])
    assert e.value.code == 2


@pytest.mark.parametrize(
    "argv", [["--tp", "0"], ["--tp", "2", "2"], ["--overlap-ab", "1"], ["--correctness", "--batch1"]]
)
def test_a_bad_benchmark_argument_is_one_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        tensor_parallel.main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.slow
def test_the_whole_run_on_the_cpu_writes_its_three_files(tmp_path):
    """Every stage in its --quick form through the shell script the device runs: two gloo ranks stand for four GPUs
    (the all-reduce table, the "70B" A/B with the overlap at 2 tokens and batch 1, the scaling pair, float32 and
    bf16 correctness, the GPU tests collected and skipped)."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        ["bash", "benchmarks/tp_device_run.sh", "--quick"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    assert proc.returncode == 0
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == 3 and "run.log" in files, files
    (result,) = [p for p in out.iterdir() if p.name.startswith("tp-cpux0-")]
    data = json.loads(result.read_text())
    assert [s["name"] for s in data["stages"]] == ["allreduce", "70b", "8b", "correctness", "tests"]
    assert all(s["rc"] == 0 and not s["timed_out"] for s in data["stages"])
    assert data["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert data["tp2_70b_tok_s"] > 0 and data["scaling_efficiency_tp2"] > 0 and data["tp2_restart_failed"] is None
    arms = data["run_70b"]["runs"][0]["arms"]
    assert [a["arm"] for a in arms] == ["plain", "overlap"]
    assert arms[0]["overlapped_forwards"] == 0 and arms[1]["overlapped_forwards"] > 0
    assert data["tp2_70b_batch1_ms_per_token"] > 0
    assert data["float32_greedy_identical_vs_tp1"] == {"tp2": "8/8"}
    assert data["float32_max_abs_logit_diff_vs_tp1"]["tp2"] < 1e-3
    assert data["gpu_tests"] == {"skipped": 6}
    assert "skipped" in (out / next(f for f in files if f.startswith("gpu-tp-tests-"))).read_text()
    assert sys.getsizeof(result.read_text()) < 16 << 20


def test_a_stage_run_without_the_allreduce_stage_measures_its_own_table(tmp_path, capsys):
    """The device run passes --allreduce-json to the 70b and 8b stages; with `--stages 70b` alone the file is not
    there, and the stage measures instead of failing (it did, FileNotFoundError, on 4x H100)."""
    import argparse

    args = argparse.Namespace(tp=[1, 2], allreduce_json=str(tmp_path / "allreduce.json"))
    tables = tensor_parallel.allreduce_tables(args, {"hidden_size": 64}, False, 2)
    assert list(tables) == ["2"] and tables["2"]
    assert "does not exist" in capsys.readouterr().out
